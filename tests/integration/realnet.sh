#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# MetaRoCE between namespaced hosts through Linux ECMP routers (tests/testbed/testbed.sh): four
# hosts, one each on af_packet and af_xdp and two on kernel UDP sockets, each with its own engine,
# joined by 2 planes of leaf-spine routers hashing on L4 ports. Unmodified ib_write_bw,
# ibv_rc_pingpong -c and our integrity program run DPDK<->DPDK, UDP<->UDP and mixed; the routers'
# own counters show traffic on every core link of every plane (the spraying); a core link is
# set down mid-transfer and the transfer completes with its data checked.
# Usage: realnet.sh BUILD_DIR.
[ "$(id -u)" -eq 0 ] || { echo "SKIP: needs root (network namespaces)"; exit 77; }
for t in ip ethtool nft; do
  command -v $t >/dev/null || { echo "SKIP: no $t (scripts/install-deps installs it)"; exit 77; }
done
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/../testbed/testbed.sh"
TB=n$$
TB_STATE_ROOT=$METAROCE_RUNDIR
# On failure each host's engine log goes with the others (cleanup prints them all).
# With each host's counters (timeouts, paths failed, stalls), read before the testbed goes.
save_engine_logs() {
  local d h
  for d in "$TB_STATE_ROOT/rn-testbed-$TB"/run-h*; do
    h=${d##*run-h}
    [ -f "$d/engine.log" ] && cp "$d/engine.log" "$LOGDIR/engine-h$h"
    tb_exec $TB "$h" timeout 10 "$METAROCE" stat rn$h >"$LOGDIR/stat-h$h" 2>&1
  done
  return 0
}
# set +e: under the errexit of lib.sh, `(exit $rc)` ended the trap before cleanup printed the
# logs (a failed run showed none, not even the engines').
trap 'rc=$?; set +e; [ $rc -ne 0 ] && save_engine_logs; tb_down $TB; (exit $rc); cleanup' EXIT
trap 'exit 143' TERM INT  # meson's timeout: the EXIT trap still removes the namespaces
PROG="$BUILD/tests/integration/integrity"

tb_up $TB --hosts "af_packet af_xdp udp udp" --planes 2 --spines 2 >"$LOGDIR/testbed"
for h in 0 1 2 3; do
  # 16 paths per plane: each host sprays over enough UDP source ports that every spine of
  # every plane sees some (P(a spine unused) = 2^-15 per host and plane).
  tb_link_add $TB $h "$METAROCE" rn$h --paths 32 >"$LOGDIR/link$h" 2>&1 ||
    { cat "$LOGDIR/link$h"; [ $h = 1 ] && grep -q "af_xdp\|xsk\|XDP" "$LOGDIR/link$h" &&
      echo "SKIP: no af_xdp here"; fail "link add on host $h"; }
done
mgmt() { echo "198.19.255.$(($1 + 1))"; }

# hpair NAME PORT LIMIT HS HC -- SERVER... -- CLIENT...: run_pair across two hosts; the client
# connects to the server's management address (SERVER_ADDR in its arguments).
hpair() {
  local name=$1 port=$2 limit=$3 hs=$4 hc=$5
  shift 6
  local server=() client=()
  while [ "$1" != "--" ]; do server+=("$1"); shift; done
  shift
  for a in "$@"; do client+=("${a//SERVER_ADDR/$(mgmt "$hs")}"); done
  tb_exec $TB "$hs" timeout "$limit" "$METAROCE" exec -- "${server[@]}" >"$LOGDIR/$name.server" 2>&1 &
  local spid=$!
  for _ in $(seq 100); do
    tb_exec $TB "$hs" ss -ltnH "sport = :$port" | grep -q . && break
    sleep 0.1
  done
  local crc=0 src=0
  tb_exec $TB "$hc" timeout "$limit" "$METAROCE" exec -- "${client[@]}" >"$LOGDIR/$name.client" 2>&1 || crc=$?
  wait $spid || src=$?
  if [ $crc -ne 0 ] || [ $src -ne 0 ]; then
    # Whole (a few dozen lines): a program's errors come first, before its buffered stdout.
    echo "== $name server (exit $src)"; tail -n 80 "$LOGDIR/$name.server"
    echo "== $name client (exit $crc)"; tail -n 80 "$LOGDIR/$name.client"
    fail "$name: server exit $src, client exit $crc"
  fi
}

read_counters() { tb_counters $TB; }
before=$(read_counters)

port=18800
# name           server client  kind
for pair in "dpdk 0 1" "udp 2 3" "mixed 0 2" "mixed_xdp 1 3"; do
  read -r name hs hc <<<"$pair"
  port=$((port + 1))
  hpair "bw_$name" $port 60 "$hs" "$hc" -- ib_write_bw -d rn$hs -x 0 -p $port -s 65536 -D 2 \
    -- ib_write_bw -d rn$hc -x 0 -p $port -s 65536 -D 2 SERVER_ADDR
  grep -E "^ *65536 " "$LOGDIR/bw_$name.client" | sed "s/^/ib_write_bw $name: /"
  port=$((port + 1))
  hpair "pp_$name" $port 60 "$hs" "$hc" -- ibv_rc_pingpong -g 0 -d rn$hs -p $port -c -n 200 -s 4096 \
    -- ibv_rc_pingpong -g 0 -d rn$hc -p $port -c -n 200 -s 4096 SERVER_ADDR
  port=$((port + 1))
  # The operator's capture of the mixed run: every opcode, and the NAKs of its error checks.
  [ "$name" = mixed ] && { tb_exec $TB 2 "$METAROCE" capture rn2 -w "$LOGDIR/int.pcap" -s 256 \
    2>"$LOGDIR/capture_int" & CAP=$!; sleep 0.3; }
  hpair "int_$name" $port 120 "$hs" "$hc" -- "$PROG" --dev rn$hs --server --port $port --listen "$(mgmt "$hs")" \
    -- "$PROG" --dev rn$hc --connect SERVER_ADDR --port $port
  # $CAP is the subshell running the function; the command itself is its child.
  [ "$name" = mixed ] && { sleep 0.3; pkill -INT -P $CAP; wait $CAP; cat "$LOGDIR/capture_int"; }
done

# Spraying: every core link of every plane carried traffic, both ways, by the routers' count.
after=$(read_counters)
echo "core links (plane leaf spine: packets leaf->spine, spine->leaf during the runs):"
idle=0
while read -r p l s up down; do
  read -r _ _ _ up0 down0 < <(grep "^$p $l $s " <<<"$before")
  echo "  $p $l $s: $((up - up0)) $((down - down0))"
  [ $((up - up0)) -ge 100 ] && [ $((down - down0)) -ge 100 ] || idle=$((idle + 1))
done <<<"$after"
[ $idle -eq 0 ] || fail "$idle core link directions carried (almost) nothing: no spraying"

# Failover: plane 0's link between leaf 0 and spine 0 goes down 1 s into a checked transfer from
# host 2 (UDP) to host 0 (af_packet); what the leaves hash onto it is lost until MetaRoCE moves
# those paths. The transfer completes and every byte is checked.
fails() {
  tb_exec $TB "$1" "$METAROCE" stat rn$1 --json | python3 -c '
import json, sys
c = json.load(sys.stdin)["counters"]
print(c.get("paths_failed", 0) + c.get("timeouts", 0))'
}
f0=$(( $(fails 0) + $(fails 2) ))
( sleep 1; tb_link $TB 0 0 0 down ) &
PIDS+=($!)
port=$((port + 1))
sizes=$(printf '4194304,%.0s' $(seq 24))1
hpair failover $port 180 0 2 -- "$PROG" --dev rn0 --server --port $port --listen "$(mgmt 0)" --sizes "$sizes" \
  -- "$PROG" --dev rn2 --connect SERVER_ADDR --port $port --sizes "$sizes"
wait
tb_link $TB 0 0 0 up
sleep 0.3  # the engines publish their counters every 100 ms
f1=$(( $(fails 0) + $(fails 2) ))
echo "failover: paths failed or timed out on hosts 0 and 2: $f0 -> $f1"
[ "$f1" -gt "$f0" ] || fail "the link went down after the transfer, or MetaRoCE never noticed"
# Operator tools. A core link flaps under a ping-pong while the UDP host captures its frames
# and logs its path events: probes and failover copies join the capture.
# Both run until the flaps are over (-d: a bound should the test lose them).
tb_exec $TB 2 "$METAROCE" capture rn2 -w "$LOGDIR/flap.pcap" -s 256 -d 60 2>"$LOGDIR/capture_flap" &
CAP=$!
tb_exec $TB 2 "$METAROCE" events rn2 -d 60 >"$LOGDIR/events" &
EV=$!
sleep 0.3
# Mid-run (a connection exists only while QPs ride it), the Prometheus export too; the links
# flap once it shows the connection's paths (a loaded host may take seconds to connect).
PATH_LINE='^metaroce_path_tx_packets_total{device="rn2",peer="198.18.1.1"'
( for _ in $(seq 200); do
    sleep 0.1
    tb_exec $TB 2 "$METAROCE" export >"$LOGDIR/metrics"
    grep -q "$PATH_LINE" "$LOGDIR/metrics" && break
  done
  sleep 0.2; tb_link $TB 0 2 0 down; tb_link $TB 1 2 1 down; sleep 1.2
  tb_link $TB 0 2 0 up; tb_link $TB 1 2 1 up; sleep 0.5 ) &
FLAP=$!
PIDS+=($FLAP)
port=$((port + 1))
hpair flap $port 60 0 2 -- ibv_rc_pingpong -g 0 -d rn0 -p $port -c -n 3000 -s 4096 \
  -- ibv_rc_pingpong -g 0 -d rn2 -p $port -c -n 3000 -s 4096 SERVER_ADDR
wait $FLAP
pkill -INT -P $CAP; pkill -INT -P $EV
wait $CAP $EV
cat "$LOGDIR/capture_flap"
grep -c . "$LOGDIR/events" | sed 's/^/path events logged: /'
for what in "failed" "entropy re-picked" "failover: "; do
  grep -q "^20[0-9-]*T[0-9:.]*Z rn2 .*$what" "$LOGDIR/events" ||
    fail "metaroce events logged no '$what' line: $(head -5 "$LOGDIR/events")"
done

# The dissector decodes every field of the MRH headers in what the tests captured, and nothing
# of ours is malformed.
LUA="$(dirname "$0")/../../dist/wireshark/metaroce.lua"
fields=(version opcode flags flags.failover flags.redundant flags.more flags.noecho flags.xrc
        flags.orig_path conn_id
        token path_id path_count
        path_seq timestamp ack_floor dst_stream src_stream msn rsn offset total_length remote_addr
        rkey imm payload_len orig_seq payload ack.cum_seq ack.sack ack.sack_word
        ack.sack_received ack.echo_timestamp ack.ecn_ce_count ack.nak_count ack.rate_hint
        nak.path_seq nak.src_stream nak.msn nak.syndrome nak.reserved)
args=()
for x in "${fields[@]}"; do args+=(-e "metaroce.$x"); done
for cap in int flap; do
  tshark -X lua_script:"$LUA" -r "$LOGDIR/$cap.pcap" -Y metaroce -T fields -E occurrence=f \
    -E separator=/t "${args[@]}" 2>"$LOGDIR/tshark.err" >>"$LOGDIR/fields" ||
    fail "tshark: $(cat "$LOGDIR/tshark.err")"
done
# A PROBE is the base header alone (its fields are checked above); whether the flap made the
# UDP host probe depends on which paths the routers hashed onto the dead links.
echo "PROBEs in the flap capture: $(tshark -X lua_script:"$LUA" -r "$LOGDIR/flap.pcap" \
  -Y 'metaroce.opcode == 17' 2>/dev/null | wc -l)"
missing=$(awk -F'\t' -v names="${fields[*]}" '
  { for (i = 1; i <= NF; i++) if ($i != "") seen[i] = 1 }
  END { n = split(names, a, " "); for (i = 1; i <= n; i++) if (!seen[i]) printf "%s ", a[i] }' \
  "$LOGDIR/fields")
[ -z "$missing" ] || fail "fields tshark never decoded: $missing"
bad=$(tshark -X lua_script:"$LUA" -r "$LOGDIR/int.pcap" -r "$LOGDIR/flap.pcap" \
  -Y 'metaroce and (_ws.malformed or _ws.expert.severity == error)' 2>/dev/null | wc -l)
[ "$bad" -eq 0 ] || fail "$bad MetaRoCE packets decoded as malformed"
echo "tshark decoded $(wc -l <"$LOGDIR/fields") MetaRoCE packets, every field present"

# The Prometheus exposition passes promtool's checks, printed and served over HTTP.
promtool check metrics <"$LOGDIR/metrics" >"$LOGDIR/promtool" 2>&1 ||
  fail "promtool check metrics: $(head -20 "$LOGDIR/promtool")"
grep -q "$PATH_LINE" "$LOGDIR/metrics" ||
  fail "no per-path counters in the export"
tb_exec $TB 2 "$METAROCE" export --listen 198.19.255.3:9477 &
EXP=$!
PIDS+=($EXP)
for _ in $(seq 50); do
  tb_exec $TB 2 ss -ltnH "sport = :9477" | grep -q . && break
  sleep 0.1
done
tb_exec $TB 0 bash -c 'exec 3<>/dev/tcp/198.19.255.3/9477; printf "GET /metrics HTTP/1.0\r\n\r\n" >&3; cat <&3' \
  >"$LOGDIR/http"
pkill -INT -P $EXP
wait $EXP
head -1 "$LOGDIR/http" | grep -q "200 OK" || fail "export --listen: $(head -3 "$LOGDIR/http")"
sed '1,/^\r$/d' "$LOGDIR/http" | promtool check metrics >/dev/null 2>&1 ||
  fail "served metrics do not pass promtool"
echo "promtool: $(grep -c '^# TYPE' "$LOGDIR/metrics") metric families pass"
echo "PASS realnet"
