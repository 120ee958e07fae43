#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# An engine that divides its links among datapath threads (`engine start --datapath-threads 3`):
# two memif pairs, so that the two devices of each pair are served by different threads. While
# ib_write_bw runs on one pair: ibv_rc_pingpong -c (every buffer checked) on the other, commands
# from every side (`stat`, `engine status`, a third link added and removed: each parks every
# thread), and an ib_write_bw client killed mid-transfer (its resources reclaimed by commands).
# Everything completes, the counts add up, no context is left behind, and the engine stops
# cleanly with its threads. Usage: datapath_threads.sh BUILD_DIR.
source "$(dirname "$0")/lib.sh"

"$METAROCE" engine start --datapath-threads 3
sock="metaroce-$TEST_NAME-$$"
"$METAROCE" link add mrA --dpdk "net_memif0,role=server,socket=$sock-1" --ip 198.18.0.1/24
"$METAROCE" link add mrB --dpdk "net_memif1,role=client,socket=$sock-1" --ip 198.18.0.2/24
"$METAROCE" link add mrC --dpdk "net_memif2,role=server,socket=$sock-2" --ip 198.18.1.1/24
"$METAROCE" link add mrD --dpdk "net_memif3,role=client,socket=$sock-2" --ip 198.18.1.2/24
eval "$("$METAROCE" env)"

[ "$("$METAROCE" engine status --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["datapath_threads"])')" = 3 ] ||
  fail "the engine does not run 3 datapath threads: $("$METAROCE" engine status)"
# thread_of DEV: the datapath thread the engine's log says serves DEV.
thread_of() { sed -n "s/.*link $1 open (.*datapath thread \([0-9]*\)).*/\1/p" "$METAROCE_RUNDIR/engine.log" | tail -n 1; }
for pair in "mrA mrB" "mrC mrD"; do
  set -- $pair
  [ -n "$(thread_of "$1")" ] && [ "$(thread_of "$1")" != "$(thread_of "$2")" ] ||
    fail "$1 and $2 are served by the same thread ($(thread_of "$1"))"
done

# The datapath threads' nice values, one line each (a woken thread preempts a spinning
# application only if it runs before it: -10 by default where CAP_SYS_NICE allows; otherwise
# what the engine inherited).
dp_nices() {
  local pid t
  pid=$("$METAROCE" engine status --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["pid"])')
  for t in /proc/"$pid"/task/*; do
    [[ $(cat "$t/comm") == metaroce-dp* ]] && awk '{print $19}' "$t/stat"
  done
}
status_nice() { "$METAROCE" engine status --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["datapath_nice"])'; }
own=$(nice)
want=$own
[ "$(id -u)" = 0 ] && want=-10
[ "$(dp_nices | sort -u)" = "$want" ] && [ "$(dp_nices | wc -l)" = 3 ] ||
  fail "datapath threads at nice $(dp_nices | tr '\n' ' '), expected 3 at $want"
[ "$(status_nice)" = "$want" ] || fail "engine status says nice $(status_nice), expected $want"

# Bulk on one pair, a checked ping-pong on the other, commands throughout.
timeout 60 ib_write_bw -d mrA -x 0 -p 18770 -s 65536 -D 6 >"$LOGDIR/bw.server" 2>&1 &
bw_server=$!
PIDS+=("$bw_server")
wait_listen 18770
timeout 60 ib_write_bw -d mrB -x 0 -p 18770 -s 65536 -D 6 127.0.0.1 >"$LOGDIR/bw.client" 2>&1 &
bw_client=$!
PIDS+=("$bw_client")
(
  for i in $(seq 20); do
    "$METAROCE" stat mrA >/dev/null && "$METAROCE" engine status >/dev/null || exit 1
    sleep 0.1
  done
  "$METAROCE" link add mrE --dpdk "net_memif4,role=server,socket=$sock-3" --ip 198.18.2.1/24 &&
    "$METAROCE" link del mrE
) >"$LOGDIR/commands" 2>&1 &
commands=$!
PIDS+=("$commands")
run_pair pingpong 18771 60 -- ibv_rc_pingpong -g 0 -d mrC -p 18771 -c -n 2000 \
  -- ibv_rc_pingpong -g 0 -d mrD -p 18771 -c -n 2000 127.0.0.1
wait "$commands" || fail "a command failed while the threads carried traffic: $(cat "$LOGDIR/commands")"
wait "$bw_client" || fail "ib_write_bw client: $(tail -n 5 "$LOGDIR/bw.client")"
wait "$bw_server" || fail "ib_write_bw server: $(tail -n 5 "$LOGDIR/bw.server")"
grep -qE '^ *65536 ' "$LOGDIR/bw.client" || fail "ib_write_bw printed no result"

# A client killed mid-transfer: its context is reclaimed, the server gives up with an error.
timeout 30 ib_write_bw -d mrC -x 0 -p 18772 -s 65536 -D 20 >"$LOGDIR/kill.server" 2>&1 &
PIDS+=($!)
wait_listen 18772
timeout 30 ib_write_bw -d mrD -x 0 -p 18772 -s 65536 -D 20 127.0.0.1 >"$LOGDIR/kill.client" 2>&1 &
victim=$!
sleep 2
kill -9 "$victim"
wait "$victim" 2>/dev/null || true
for _ in $(seq 100); do
  [ "$(engine_count contexts)" -le 1 ] && break
  sleep 0.1
done
[ "$(engine_count contexts)" -le 1 ] || fail "the killed client's context was not reclaimed"
run_pair after_kill 18773 60 -- ibv_rc_pingpong -g 0 -d mrD -p 18773 -c -n 200 \
  -- ibv_rc_pingpong -g 0 -d mrC -p 18773 -c -n 200 127.0.0.1

"$METAROCE" engine stop
grep -q "metaroced: stopped" "$METAROCE_RUNDIR/engine.log" ||
  fail "the engine did not stop cleanly: $(tail -n 5 "$METAROCE_RUNDIR/engine.log")"

# Spinning always, the same; --nice sets another (a higher one needs no privilege).
"$METAROCE" engine start --datapath-threads 2 --spin always
[ "$(dp_nices | sort -u)" = "$want" ] || fail "--spin always threads at nice $(dp_nices | tr '\n' ' '), expected $want"
"$METAROCE" engine stop
"$METAROCE" engine start --datapath-threads 2 --spin always --nice 5
[ "$(dp_nices | sort -u)" = 5 ] && [ "$(status_nice)" = 5 ] ||
  fail "--nice 5 threads at nice $(dp_nices | tr '\n' ' ') (status $(status_nice))"
"$METAROCE" engine stop
echo "OK: 3 datapath threads carried bulk and a checked ping-pong under commands and a kill"
