#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Throughput of MetaRoCE over a veth pair between two network namespaces, per port kind
# (af_xdp, af_packet, kernel UDP sockets), beside iperf3 (TCP, and UDP at full rate) over the
# same veth pair with the same MTU, measured in the same run. Prints one JSON object.
# Usage: realnet.sh BUILD_DIR SECONDS [KIND...]   (needs root, iperf3, perftest)
set -euo pipefail
BUILD=$(cd "$1" && pwd)
SECS=$2
shift 2
KINDS=("${@:-af_xdp af_packet udp}")
KINDS=(${KINDS[*]})
METAROCE="$BUILD/util/metaroce"
ID=b$$
A=rn-$ID-a B=rn-$ID-b
RUN=$(mktemp -d /tmp/rn-bench.XXXXXX)
cleanup() {
  for ns in $A $B; do
    ip netns exec $ns env METAROCE_RUNDIR=$RUN/$ns "$METAROCE" link flush >/dev/null 2>&1 || true
    ip netns exec $ns env METAROCE_RUNDIR=$RUN/$ns "$METAROCE" engine stop >/dev/null 2>&1 || true
    ip netns pids $ns 2>/dev/null | xargs -r kill 2>/dev/null || true
    ip netns del $ns 2>/dev/null || true
  done
  rm -rf "$RUN"
}
trap cleanup EXIT
trap 'exit 143' TERM INT
in_ns() { local ns=$1; shift; ip netns exec $ns env METAROCE_RUNDIR=$RUN/$ns "$@"; }

# gbps_iperf NS_SERVER NS_CLIENT ADDR [-u]: iperf3's receiver-side Gbit/s.
gbps_iperf() {
  local s=$1 c=$2 addr=$3
  shift 3
  in_ns $s timeout $((SECS + 20)) iperf3 -s -1 -B "$addr" -p 5299 >/dev/null 2>&1 &
  local pid=$!
  for _ in $(seq 50); do in_ns $s ss -ltnH "sport = :5299" | grep -q . && break; sleep 0.1; done
  in_ns $c timeout $((SECS + 20)) iperf3 -c "$addr" -p 5299 -t "$SECS" -J "$@" >"$RUN/iperf.json"
  wait $pid || true
  python3 -c '
import json, sys
e = json.load(open(sys.argv[1]))["end"]
s = e.get("sum_received") or e.get("sum")
print(round(s["bits_per_second"] / 1e9, 3))' "$RUN/iperf.json"
}

out="{"
first=1
for kind in "${KINDS[@]}"; do
  mtu=9000
  [ "$kind" = af_xdp ] && mtu=3442
  ip netns add $A; ip netns add $B
  mkdir -p $RUN/$A $RUN/$B
  for ns in $A $B; do ip -n $ns link set lo up; done
  ip link add rn-d netns $A mtu $mtu type veth peer name rn-d netns $B mtu $mtu
  ip link add rn-m netns $A type veth peer name rn-m netns $B
  ip -n $A addr add 198.18.9.1/24 dev rn-d; ip -n $B addr add 198.18.9.2/24 dev rn-d
  ip -n $A addr add 198.19.9.1/24 dev rn-m; ip -n $B addr add 198.19.9.2/24 dev rn-m
  for ns in $A $B; do ip -n $ns link set rn-d up; ip -n $ns link set rn-m up; done
  # The reference: the kernel's own TCP and UDP over this veth pair.
  tcp=$(gbps_iperf $B $A 198.18.9.2)
  udp=$(gbps_iperf $B $A 198.18.9.2 -u -b 0 -l $((mtu - 28)) 2>/dev/null)
  case $kind in
    af_packet|af_xdp)
      # DPDK reads frames as they are; the kernel addresses stay off the device's way.
      ip -n $A addr flush dev rn-d; ip -n $B addr flush dev rn-d
      in_ns $A "$METAROCE" link add bn --dpdk "net_${kind}0,iface=rn-d" --ip 198.18.9.1/24 >/dev/null
      in_ns $B "$METAROCE" link add bn --dpdk "net_${kind}1,iface=rn-d" --ip 198.18.9.2/24 >/dev/null ;;
    udp)
      in_ns $A "$METAROCE" link add bn --udp rn-d --ip 198.18.9.1/24 >/dev/null
      in_ns $B "$METAROCE" link add bn --udp rn-d --ip 198.18.9.2/24 >/dev/null ;;
  esac
  in_ns $B timeout $((SECS + 30)) "$METAROCE" exec -- ib_write_bw -d bn -x 0 -s 65536 -D "$SECS" \
    -p 18990 >"$RUN/bw.server" 2>&1 &
  spid=$!
  for _ in $(seq 50); do in_ns $B ss -ltnH "sport = :18990" | grep -q . && break; sleep 0.1; done
  in_ns $A timeout $((SECS + 30)) "$METAROCE" exec -- ib_write_bw -d bn -x 0 -s 65536 -D "$SECS" \
    -p 18990 198.19.9.2 >"$RUN/bw.client" 2>&1 || { cat "$RUN/bw.client" >&2; exit 1; }
  wait $spid || true
  mr=$(awk '$1 == 65536 { printf "%.3f", $4 * 1048576 * 8 / 1e9 }' "$RUN/bw.client")
  [ -n "$mr" ] || { cat "$RUN/bw.client" >&2; exit 1; }
  [ $first -eq 1 ] || out+=", "
  first=0
  out+="\"$kind\": {\"mtu\": $mtu, \"metaroce_gbps\": $mr, \"iperf3_tcp_gbps\": $tcp, \"iperf3_udp_gbps\": $udp}"
  for ns in $A $B; do
    in_ns $ns "$METAROCE" link flush >/dev/null 2>&1 || true
    in_ns $ns "$METAROCE" engine stop >/dev/null 2>&1 || true
    ip netns del $ns
  done
done
echo "$out}"
