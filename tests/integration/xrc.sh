#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# XRC between real processes (docs/spec/verbs-mapping.md §17): an initiator on mrA sends to the
# SRQs of two processes of mrB that share an XRC domain by its file, alternating between them;
# RDMA and atomics go through each SRQ's PD. The process that made the target QP is killed while
# the initiator streams to the other's SRQ: the other holds the QP open, so the stream goes on;
# a request for the killed process's SRQ is then an invalid request.
source "$(dirname "$0")/lib.sh"
PROG="$BUILD/tests/integration/xrc"
[ -x "$PROG" ] || fail "$PROG is not built"
make_pair
dir="$METAROCE_RUNDIR/xrc"
mkdir -p "$dir"
file="$dir/domain"

# contexts_of PID: how many device contexts the engine serves for process PID.
contexts_of() {
  "$METAROCE" engine status --json | /usr/bin/python3 -c \
    'import json,sys; print(sum(1 for c in json.load(sys.stdin)["contexts"] if c["pid"] == int(sys.argv[1])))' "$1"
}
# wait_line FILE LINE PID: until FILE has LINE (60 s), failing if PID exited first.
wait_line() {
  for _ in $(seq 600); do
    grep -qx "$2" "$1" && return 0
    kill -0 "$3" 2>/dev/null || { cat "$1"; fail "$(basename "$1") exited before '$2'"; }
    sleep 0.1
  done
  cat "$1"
  fail "no '$2' in $(basename "$1")"
}

# Started directly (not under timeout) so that $! is the program the engine serves; each role
# gives up by itself after 30-60 s of waiting.
"$PROG" --role initiator --dev mrA --dir "$dir" >"$LOGDIR/initiator" 2>&1 &
ini=$!
"$PROG" --role target --dev mrB --dir "$dir" --file "$file" >"$LOGDIR/target" 2>&1 &
tgt=$!
"$PROG" --role peer --dev mrB --dir "$dir" --file "$file" >"$LOGDIR/peer" 2>&1 &
peer=$!
PIDS+=("$ini" "$tgt" "$peer")
wait_line "$LOGDIR/target" "target ok" "$tgt"
wait_line "$LOGDIR/initiator" "phase2" "$ini"
[ "$(contexts_of "$tgt")" -eq 1 ] || fail "the engine does not serve the target process"
kill -KILL "$tgt"
wait "$tgt" 2>/dev/null || true
for _ in $(seq 100); do [ "$(contexts_of "$tgt")" -eq 0 ] && break; sleep 0.05; done
[ "$(contexts_of "$tgt")" -eq 0 ] || fail "the engine still serves the killed target process"
touch "$dir/killed"
rc=0
wait "$ini" || rc=$?
[ "$rc" -eq 0 ] || { cat "$LOGDIR/initiator"; fail "initiator (exit $rc)"; }
wait "$peer" || rc=$?
[ "$rc" -eq 0 ] || { cat "$LOGDIR/peer"; fail "peer (exit $rc)"; }
# Nothing of either is left in the engine.
for p in "$ini" "$peer"; do
  [ "$(contexts_of "$p")" -eq 0 ] || fail "the engine still serves process $p"
done
grep "phase 2:" "$LOGDIR/initiator" || true
echo "PASS xrc"
