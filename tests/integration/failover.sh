#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# A failed link never reaches the application, whatever the traffic (docs/spec/congestion.md §4):
# unmodified ibv_rc_pingpong -c (2 B, 4 KiB, 64 KiB; -c checks every received buffer),
# ib_send_lat, ib_read_lat and ib_atomic_lat through `metaroce fabric`, with (1) the busiest of
# 8 core links black-holed mid-run and (2) a whole plane of a 2-plane fabric down mid-run: both
# sides of every run exit 0, and the fabric shows that the failure was hit. (3) ibv_rc_pingpong
# -c 64 KiB at 10 % loss on every core link, 10 runs in a row, both sides exit 0 (the last
# acknowledgement: a client that is done and closes its device still answers the server's
# resends). Usage: failover.sh BUILD_DIR.
# FAILOVER_ONLY=core|plane|loss runs one part.
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/lib.sh"
[ -x "$BUILD/datapath/fabric/fabric_probe" ] || { echo "SKIP: built without DPDK"; exit 77; }
PY=/usr/bin/python3
[ -x "$PY" ] || PY=python3
FAB="fo$$"
PORT=18600
only=${FAILOVER_ONLY:-}

stop_all() { fabric_pair_stop "$FAB"; }
# cleanup (lib.sh) exits with the status it finds in $?: hand it the script's, not stop_all's.
trap 'rc=$?; set +e; stop_all; (exit "$rc"); cleanup' EXIT

# fabric PLANES LINKS [options]: a 2-endpoint fabric and the devices fA (endpoint 0), fB (1).
fabric() {
  local planes=$1 links=$2
  shift 2
  fabric_pair "$FAB" "$planes" "$links" 5 "$@"
}

# fault WHAT: in the background, the fault of failover_fault.py (busiest-core or plane1).
fault() {
  "$PY" "$HERE/failover_fault.py" "$METAROCE" "$FAB" down "$1" "$LOGDIR/down" \
    >"$LOGDIR/fault.log" 2>&1 &
  FAULT_PID=$!
}

# hit NAME: the failure happened during the run and dropped frames (else the run proved
# nothing); the link comes back up for the next program, which must meet its failure mid-run.
hit() {
  local name=$1 what
  wait "$FAULT_PID" || fail "$name: the fault was not injected: $(cat "$LOGDIR/fault.log")"
  FAULT_PID=""
  what=$("$PY" "$HERE/failover_fault.py" "$METAROCE" "$FAB" check "$LOGDIR/down") ||
    fail "$name: the failure missed the run: $what"
  echo "ok: $name, both sides exit 0 after $what went down"
}

# run_case NAME FAULT PROGRAM ARGS...: server (-d fA) and client (-d fB, the server's address)
# through the fabric while the fault strikes mid-run; @PORT@ in ARGS is the TCP port.
run_case() {
  local name=$1 what=$2
  shift 2
  PORT=$((PORT + 1))
  fault "$what"
  local cmd=("${@//@PORT@/$PORT}")
  run_pair "$name" "$PORT" 240 -- "${cmd[@]}" -d fA -- "${cmd[@]}" -d fB 127.0.0.1
  hit "$name"
}

# The fault strikes about 0.2 s after the run's traffic starts (failover_fault.py), later on a
# loaded host (each `metaroce fabric` call is a process); each run is long enough to be still
# going then, and much longer, wherever it runs: a 2 B round trip through the emulator takes
# 35 us to 0.4 ms on a 2-core host (5000 READs once ended in 0.18 s, before the fault), so the
# shortest run here lasts ~1 s, and a faster host makes both the run and the fault's wait for
# traffic shorter. `hit` fails the case if the failure missed the run. (With registered pages
# shared with the engine, 1,500 64 KiB round trips took 0.21 s: hence 8,000.)
programs() {
  local what=$1
  run_case "pingpong-2B-$what" "$what" ibv_rc_pingpong -c -g 0 -p @PORT@ -s 2 -n 40000
  run_case "pingpong-4K-$what" "$what" ibv_rc_pingpong -c -g 0 -p @PORT@ -s 4096 -n 40000
  run_case "pingpong-64K-$what" "$what" ibv_rc_pingpong -c -g 0 -p @PORT@ -s 65536 -n 8000
  run_case "send_lat-$what" "$what" ib_send_lat -x 0 -p @PORT@ -s 2 -n 30000
  run_case "read_lat-$what" "$what" ib_read_lat -x 0 -p @PORT@ -s 2 -n 30000
  run_case "atomic_lat-$what" "$what" ib_atomic_lat -x 0 -p @PORT@ -n 30000
}

if [ -z "$only" ] || [ "$only" = core ]; then
  fabric 1 8
  programs busiest-core
  stop_all
fi

if [ -z "$only" ] || [ "$only" = plane ]; then
  fabric 2 2
  programs plane1
  stop_all
fi

if [ -z "$only" ] || [ "$only" = loss ]; then
  fabric 1 8 --loss 0.1
  for i in $(seq 10); do
    PORT=$((PORT + 1))
    run_pair "loss10-$i" "$PORT" 240 -- ibv_rc_pingpong -c -g 0 -p "$PORT" -s 65536 -n 200 -d fA \
      -- ibv_rc_pingpong -c -g 0 -p "$PORT" -s 65536 -n 200 -d fB 127.0.0.1
    echo "ok: 64 KiB ping-pong at 10 % loss, run $i of 10"
  done
  stop_all
fi
echo "PASS failover"
