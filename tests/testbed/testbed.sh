#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# A testbed of network namespaces: H hosts x P planes, each plane a leaf-spine network of Linux
# routers (namespaces) with ECMP on L4 hashes (fib_multipath_hash_policy=1), veth links with tbf
# rate limits, random loss and random CE marking (nftables). Each host runs its own MetaRoCE
# engine (its own run dir) with a device on af_packet, af_xdp or UDP sockets, one port per plane,
# and a management link (a bridge) for the programs' TCP exchange. Addresses: 198.18.0.0/15 only.
#
#   testbed.sh up ID --hosts "KIND..." [--planes P] [--spines K] [--rate R] [--loss PERMILLE]
#                    [--ecn PERMILLE] [--delay D] [--reorder PCT]
#   testbed.sh down ID           everything of ID (namespaces, engines, run dirs)
#   testbed.sh exec ID H CMD...  CMD in host H's namespace, with its run dir
#   testbed.sh counters ID       tx packets of every core link, per plane, leaf and spine
#   testbed.sh link ID P L K up|down   the core link of plane P between leaf L and spine K
#
# KIND is af_packet, af_xdp or udp, one per host. Sourced, the same are functions tb_up, tb_down,
# tb_exec, tb_counters, tb_link. Names: namespaces rn-ID-h<h> (hosts), rn-ID-p<p>l<l> (leaves),
# rn-ID-p<p>s<k> (spines), rn-ID-m (management bridge); interfaces inside them rn-*.
#
# Addressing: host h's device 198.18.1.<h+1> (on lo for a UDP host, nowhere in the kernel for a
# DPDK host); host h on plane p 198.19.<p>.<2h>/31, its leaf 198.19.<p>.<2h+1>; the core link of
# plane p between leaf l and spine k 198.19.<32+p>.<2(lK+k)>/31 (leaf) and +1 (spine);
# management 198.19.255.<h+1>/24.
#
# What this kernel lacks: there is no netem, red, fq_codel, pie or choke qdisc and no tc
# classifier or action here (only tbf, htb, pfifo, bfifo), so there is no fixed delay, no
# reordering by the link and no ECN marking by queue depth. --delay and --reorder fail with that
# reason where netem is missing; --ecn marks CE at random (nftables `ip ecn set ce`) on
# ECN-capable packets, which exercises the echo and the window cut, not queue control; reordering
# comes from spraying over unequal paths (--rate per link makes the queues differ).
set -euo pipefail

TB_STATE_ROOT=${TB_STATE_ROOT:-/tmp}

tb_die() { echo "testbed: $*" >&2; return 1; }

# tb_ns ID ROLE: the namespace name.
tb_ns() { echo "rn-$1-$2"; }

tb_sysctl() { ip netns exec "$1" sysctl -q -w "$2" >/dev/null; }

# tb_veth NS_A IF_A NS_B IF_B MTU
tb_veth() {
  ip link add "$2" netns "$1" mtu "$5" type veth peer name "$4" netns "$3" mtu "$5"
  ip -n "$1" link set "$2" up
  ip -n "$3" link set "$4" up
}

# tb_shape NS IF: the testbed's rate limit on the egress of IF.
tb_shape() {
  [ -n "${TB_RATE:-}" ] || return 0
  ip netns exec "$1" tc qdisc replace dev "$2" root tbf rate "$TB_RATE" burst 256k latency 20ms
}

# tb_router NS: forwarding, L4 ECMP, loss and CE marking on what it forwards.
tb_router() {
  local ns=$1
  ip netns add "$ns"
  ip -n "$ns" link set lo up
  tb_sysctl "$ns" net.ipv4.ip_forward=1
  tb_sysctl "$ns" net.ipv4.fib_multipath_hash_policy=1
  tb_sysctl "$ns" net.ipv4.conf.all.rp_filter=0
  tb_sysctl "$ns" net.ipv4.conf.default.rp_filter=0
  if [ "${TB_LOSS:-0}" != 0 ] || [ "${TB_ECN:-0}" != 0 ]; then
    ip netns exec "$ns" nft add table ip rn_testbed
    ip netns exec "$ns" nft add chain ip rn_testbed forward_chain '{ type filter hook forward priority 0; }'
    [ "${TB_LOSS:-0}" != 0 ] &&
      ip netns exec "$ns" nft add rule ip rn_testbed forward_chain numgen random mod 1000 '<' "$TB_LOSS" drop
    [ "${TB_ECN:-0}" != 0 ] &&
      ip netns exec "$ns" nft add rule ip rn_testbed forward_chain ip ecn != not-ect numgen random mod 1000 '<' \
        "$TB_ECN" ip ecn set ce
  fi
  return 0
}

tb_up() {
  local id=$1
  shift
  local kinds="" planes=2 spines=2
  TB_RATE="" TB_LOSS=0 TB_ECN=0
  while [ $# -gt 0 ]; do
    case $1 in
      --hosts) kinds=$2; shift 2 ;;
      --planes) planes=$2; shift 2 ;;
      --spines) spines=$2; shift 2 ;;
      --rate) TB_RATE=$2; shift 2 ;;
      --loss) TB_LOSS=$2; shift 2 ;;
      --ecn) TB_ECN=$2; shift 2 ;;
      --delay|--reorder)
        tc qdisc add dev lo root netem delay 1ms 2>/dev/null &&
          { tc qdisc del dev lo root; tb_die "$1 is not implemented yet"; return 1; }
        tb_die "$1 needs the netem qdisc, which this kernel does not have"; return 1 ;;
      *) tb_die "unknown option $1"; return 1 ;;
    esac
  done
  [[ "$id" =~ ^[a-z0-9]{1,6}$ ]] || { tb_die "ID: 1..6 of [a-z0-9]"; return 1; }
  local -a kind=($kinds)
  local hosts=${#kind[@]}
  [ "$hosts" -ge 2 ] && [ "$hosts" -le 100 ] || { tb_die "--hosts: 2..100 kinds"; return 1; }
  [ "$planes" -ge 1 ] && [ "$planes" -le 8 ] || { tb_die "--planes: 1..8"; return 1; }
  [ "$spines" -ge 1 ] && [ $((hosts * spines)) -le 128 ] || { tb_die "--spines: 1..128/hosts"; return 1; }
  local k mtu=9000
  for k in "${kind[@]}"; do
    case $k in
      af_packet|udp) ;;
      af_xdp) mtu=3442 ;;  # one page per af_xdp frame (metaroce link add --help)
      *) tb_die "host kind '$k': af_packet, af_xdp or udp"; return 1 ;;
    esac
  done
  local state="$TB_STATE_ROOT/rn-testbed-$id"
  [ -e "$state" ] && { tb_die "testbed $id exists ($state)"; return 1; }
  mkdir -p "$state"
  printf '%s\n' "hosts=$hosts" "planes=$planes" "spines=$spines" "mtu=$mtu" "kinds='$kinds'" \
    >"$state/config"

  # Management: a bridge every host hangs off, for perftest's TCP exchange.
  local m; m=$(tb_ns "$id" m)
  ip netns add "$m"
  ip -n "$m" link add rn-br type bridge
  ip -n "$m" link set rn-br up

  local h p l s hn ln sn
  for ((h = 0; h < hosts; h++)); do
    hn=$(tb_ns "$id" "h$h")
    ip netns add "$hn"
    ip -n "$hn" link set lo up
    tb_sysctl "$hn" net.ipv4.conf.all.rp_filter=0
    tb_sysctl "$hn" net.ipv4.conf.default.rp_filter=0
    tb_veth "$hn" rn-m "$m" "rn-h$h" 1500
    ip -n "$m" link set "rn-h$h" master rn-br
    ip -n "$hn" addr add "198.19.255.$((h + 1))/24" dev rn-m
    [ "${kind[$h]}" = udp ] && ip -n "$hn" addr add "198.18.1.$((h + 1))/32" dev lo
  done
  for ((p = 0; p < planes; p++)); do
    for ((s = 0; s < spines; s++)); do tb_router "$(tb_ns "$id" "p${p}s$s")"; done
    for ((l = 0; l < hosts; l++)); do
      ln=$(tb_ns "$id" "p${p}l$l")
      hn=$(tb_ns "$id" "h$l")
      tb_router "$ln"
      # Host l on this plane.
      tb_veth "$hn" "rn-p$p" "$ln" rn-h "$mtu"
      ip -n "$hn" addr add "198.19.$p.$((2 * l))/31" dev "rn-p$p"
      ip -n "$ln" addr add "198.19.$p.$((2 * l + 1))/31" dev rn-h
      ip -n "$hn" route add 198.18.1.0/24 via "198.19.$p.$((2 * l + 1))" dev "rn-p$p" metric $((100 + p))
      ip -n "$ln" route add "198.18.1.$((l + 1))/32" dev rn-h
      tb_shape "$ln" rn-h
      # A DPDK port reads frames as the wire carries them: checksums the kernel left to
      # offload (CHECKSUM_PARTIAL from a UDP host's socket) must be finished before they reach
      # it, and GSO super-frames cut to the MTU.
      [ "${kind[$l]}" != udp ] && ip netns exec "$ln" ethtool -K rn-h tx off >/dev/null
      # Its spines.
      local hops=()
      for ((s = 0; s < spines; s++)); do
        sn=$(tb_ns "$id" "p${p}s$s")
        local n=$((2 * (l * spines + s)))
        tb_veth "$ln" "rn-s$s" "$sn" "rn-l$l" "$mtu"
        ip -n "$ln" addr add "198.19.$((32 + p)).$n/31" dev "rn-s$s"
        ip -n "$sn" addr add "198.19.$((32 + p)).$((n + 1))/31" dev "rn-l$l"
        ip -n "$sn" route add "198.18.1.$((l + 1))/32" via "198.19.$((32 + p)).$n" dev "rn-l$l"
        tb_shape "$ln" "rn-s$s"
        tb_shape "$sn" "rn-l$l"
        hops+=(nexthop via "198.19.$((32 + p)).$((n + 1))" dev "rn-s$s")
      done
      ip -n "$ln" route add 198.18.1.0/24 "${hops[@]}"
    done
  done
  echo "testbed $id: $hosts hosts (${kinds}), $planes planes x $spines spines, MTU $mtu"
}

tb_config() {
  local state="$TB_STATE_ROOT/rn-testbed-$1"
  [ -f "$state/config" ] || { tb_die "no testbed $1"; return 1; }
  # shellcheck disable=SC1091
  source "$state/config"
}

# tb_rundir ID H: host H's MetaRoCE run dir.
tb_rundir() { echo "$TB_STATE_ROOT/rn-testbed-$1/run-h$2"; }

# tb_exec ID H CMD...: CMD in host H's namespace with its run dir.
tb_exec() {
  local id=$1 h=$2
  shift 2
  mkdir -p "$(tb_rundir "$id" "$h")"
  ip netns exec "$(tb_ns "$id" "h$h")" env METAROCE_RUNDIR="$(tb_rundir "$id" "$h")" "$@"
}

# tb_link_add ID H METAROCE [NAME]: host H's MetaRoCE device (default rn<H>) on its kind of port,
# one per plane.
tb_link_add() {
  local id=$1 h=$2 metaroce=$3 name=${4:-rn$2}
  tb_config "$id" || return 1
  local -a kind=($kinds) ports=()
  local p
  for ((p = 0; p < planes; p++)); do
    case ${kind[$h]} in
      af_packet) ports+=(--dpdk "net_af_packet$p,iface=rn-p$p") ;;
      af_xdp) ports+=(--dpdk "net_af_xdp$p,iface=rn-p$p") ;;
      udp) ports+=(--udp "rn-p$p") ;;
    esac
  done
  tb_exec "$id" "$h" "$metaroce" link add "$name" "${ports[@]}" --ip "198.18.1.$((h + 1))/24"
}

# tb_counters ID: "plane leaf spine up down" per core link: packets the leaf sent to the spine
# and the spine to the leaf, as the routers' interfaces count them.
tb_counters() {
  tb_config "$1" || return 1
  local p l s
  for ((p = 0; p < planes; p++)); do
    for ((l = 0; l < hosts; l++)); do
      for ((s = 0; s < spines; s++)); do
        echo "$p $l $s" \
          "$(ip netns exec "$(tb_ns "$1" "p${p}l$l")" cat "/sys/class/net/rn-s$s/statistics/tx_packets")" \
          "$(ip netns exec "$(tb_ns "$1" "p${p}s$s")" cat "/sys/class/net/rn-l$l/statistics/tx_packets")"
      done
    done
  done
}

# tb_link ID P L K up|down: the core link (set on the spine's side: the leaf sees no carrier but
# keeps its route, so what it hashes there is lost, as behind a failed optic).
tb_link() { ip -n "$(tb_ns "$1" "p$2s$4")" link set "rn-l$3" "$5"; }

tb_down() {
  local id=$1 state="$TB_STATE_ROOT/rn-testbed-$1" d ns
  for d in "$state"/run-h*; do
    [ -d "$d" ] || continue
    local h=${d##*run-h}
    ns=$(tb_ns "$id" "h$h")
    if [ -n "${METAROCE:-}" ] && ip netns list | grep -qw "$ns"; then
      ip netns exec "$ns" env METAROCE_RUNDIR="$d" "$METAROCE" link flush >/dev/null 2>&1 || true
      ip netns exec "$ns" env METAROCE_RUNDIR="$d" "$METAROCE" engine stop >/dev/null 2>&1 || true
    fi
  done
  for ns in $(ip netns list | awk '{print $1}' | grep "^rn-$id-" || true); do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
  rm -rf "$state"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  cmd=${1:-}
  [ $# -ge 2 ] || { sed -n '3,15p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
  shift
  case $cmd in
    up) tb_up "$@" ;;
    down) tb_down "$@" ;;
    exec) tb_exec "$@" ;;
    counters) tb_counters "$@" ;;
    link) tb_link "$@" ;;
    *) echo "testbed: unknown command $cmd" >&2; exit 2 ;;
  esac
fi
