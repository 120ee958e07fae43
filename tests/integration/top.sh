#!/bin/bash
# SPDX-License-Identifier: Apache-2.0
# `metaroce top` as an operator sees it: in an 80x24 terminal (tmux) against a live engine while
# ib_write_bw runs through `metaroce fabric` and the busiest core link is black-holed mid-transfer.
# The pane shows that link's paths failed with the traffic moved to the others, then, once the
# link is back, every path active again; `q` and Ctrl-C quit with status 0, and a terminal
# smaller than 80x24 is refused. `metaroce record` of the same
# run replayed by `top --replay` gives the same path failures in the same order as
# `metaroce events` logged live, and bench/plot_record draws it. Last, the engine is killed under
# a plain-text `top`, which exits 1 saying so. Midway, every query of the Grafana dashboard
# (dist/grafana/metaroce.json) must name a metric `metaroce export` emits. Usage: top.sh BUILD_DIR.
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/lib.sh"
[ -x "$BUILD/datapath/fabric/fabric_probe" ] || { echo "SKIP: built without DPDK"; exit 77; }
command -v tmux >/dev/null || { echo "SKIP: no tmux (scripts/install-deps installs it)"; exit 77; }
PY=/usr/bin/python3
[ -x "$PY" ] || PY=python3
FAB="top$$"
PORT=18690
TMUX_SOCK="metaroce-top-$$"
SESSION=top
tm() { tmux -L "$TMUX_SOCK" "$@"; }
stop_all() {
  tm kill-server 2>/dev/null || true
  fabric_pair_stop "$FAB"
}
trap 'rc=$?; set +e; stop_all; (exit "$rc"); cleanup' EXIT

# pane NAME: the terminal's text now, kept in $LOGDIR/pane-NAME.txt.
pane() { tm capture-pane -p -t "$SESSION" | tee "$LOGDIR/pane-$1.txt"; }
# rows: the path rows of a pane on stdin, as "STATE MBIT/S" lines.
rows() { awk '$1 ~ /^\*?fB>198\.18\.0\.1/ { print $5, $6 }'; }
# wait_pane NAME SECONDS AWK_CONDITION: until the pane's rows meet the condition (awk over
# "STATE MBIT/S" lines, ending in a true/false exit), else fail showing the last pane.
wait_pane() {
  local name=$1 secs=$2 cond=$3
  for _ in $(seq $((secs * 4))); do
    if pane "$name" | rows | awk "$cond" >/dev/null; then return 0; fi
    sleep 0.25
  done
  fail "$name: the pane never showed it: $(cat "$LOGDIR/pane-$name.txt")
now $(date +%s%N), the engine's last snapshot: $("$METAROCE" stat fB --json | head -c 160)"
}

# With TOP_KEEP (the picture for the docs) each phase lasts a few seconds more.
hold() { if [ -n "${TOP_KEEP:-}" ]; then sleep 3; fi; }

fabric_pair "$FAB" 1 8 5
ib_write_bw -x 0 -s 65536 -D 60 -p "$PORT" -d fA >"$LOGDIR/server.log" 2>&1 &
PIDS+=($!)
wait_listen "$PORT"
ib_write_bw -x 0 -s 65536 -D 60 -p "$PORT" -d fB 127.0.0.1 >"$LOGDIR/client.log" 2>&1 &
PIDS+=($!)
"$METAROCE" record fB -o "$LOGDIR/run.rec" -d 120 2>"$LOGDIR/record.log" &
REC=$!
"$METAROCE" events fB -d 120 >"$LOGDIR/events.log" 2>&1 &
EVENTS=$!
PIDS+=("$REC" "$EVENTS")
tm new-session -d -s "$SESSION" -x 80 -y 24 \
  "env METAROCE_RUNDIR='$METAROCE_RUNDIR' LD_PRELOAD='$SAN_PRELOAD' '$METAROCE' top fB -d 0.5 \
   2>'$LOGDIR/top.err'; echo \$? >'$LOGDIR/top.rc'; sleep 600"

# Traffic on at least two paths before the fault.
wait_pane flowing 60 '$1 == "active" && $2 > 0 { n++ } END { exit !(n >= 2) }'
hold
"$PY" "$HERE/failover_fault.py" "$METAROCE" "$FAB" down busiest-core "$LOGDIR/down" \
  >"$LOGDIR/fault.log" 2>&1 || fail "the fault was not injected: $(cat "$LOGDIR/fault.log")"
# The black-holed link's paths are taken out of service (failed, then probing until it answers
# again; on a loaded 2-core host other paths also fail now and then when the engine is starved
# past their timeout), the failure is in the events below, and the traffic goes on over the
# paths still active.
# A failed path re-picks its port and is often back within the refresh: top shows it
# "flapped" then.
wait_pane failed 30 '$1 == "failed" || $1 == "probing" || $1 == "flapped" { f++ } END { exit !(f >= 1) }'
grep -Eq '^\*fB>.* (failed|probing|flapped) ' "$LOGDIR/pane-failed.txt" ||
  fail "a failed path is not marked worst"
wait_pane moved 30 '($1 == "active" || $1 == "flapped") && $2 > 0 { a++ } END { exit !(a >= 2) }'
grep -q 'failed (' "$LOGDIR/pane-failed.txt" "$LOGDIR/pane-moved.txt" ||
  fail "the events below do not show the failure"
echo "ok: top marks the black-holed link's paths failed and shows the traffic moved"
hold
# The Grafana dashboard's queries name metrics the exporter emits, here, with a failure seen.
"$METAROCE" export >"$LOGDIR/export.txt" || fail "metaroce export failed"
"$PY" "$HERE/dashboard_check.py" "$HERE/../../dist/grafana/metaroce.json" "$LOGDIR/export.txt" ||
  fail "the dashboard names metrics the exporter does not emit"
echo "ok: every query of dist/grafana/metaroce.json names a metric metaroce export emits"
what=$("$PY" "$HERE/failover_fault.py" "$METAROCE" "$FAB" check "$LOGDIR/down") ||
  fail "the failure missed the run: $what"
# Back up: every path in service again (active, or flapped: failed and back within the refresh,
# as paths on a starved 2-core host do several times a second).
wait_pane recovered 60 '$1 != "active" && $1 != "flapped" { bad++ } { n++ } END { exit !(n >= 2 && !bad) }'
echo "ok: after $what came back, top shows every path active"
hold
tm send-keys -t "$SESSION" q
for _ in $(seq 40); do [ -s "$LOGDIR/top.rc" ] && break; sleep 0.25; done
[ "$(cat "$LOGDIR/top.rc" 2>/dev/null)" = 0 ] || fail "top did not quit with 0 on q: $(cat "$LOGDIR/top.err")"
echo "ok: q quits top with status 0"
# Ctrl-C quits too; a terminal smaller than 80x24 is refused with a message and status 1.
tm new-session -d -s ctrlc -x 80 -y 24 \
  "env METAROCE_RUNDIR='$METAROCE_RUNDIR' LD_PRELOAD='$SAN_PRELOAD' '$METAROCE' top fB; \
   echo \$? >'$LOGDIR/ctrlc.rc'; sleep 600"
for _ in $(seq 40); do tm capture-pane -p -t ctrlc | grep -q 'fB>198' && break; sleep 0.25; done
tm send-keys -t ctrlc C-c
tm new-session -d -s small -x 60 -y 20 \
  "env METAROCE_RUNDIR='$METAROCE_RUNDIR' LD_PRELOAD='$SAN_PRELOAD' '$METAROCE' top fB \
   2>'$LOGDIR/small.err'; echo \$? >'$LOGDIR/small.rc'; sleep 600"
for _ in $(seq 40); do [ -s "$LOGDIR/ctrlc.rc" ] && [ -s "$LOGDIR/small.rc" ] && break; sleep 0.25; done
[ "$(cat "$LOGDIR/ctrlc.rc" 2>/dev/null)" = 0 ] || fail "top did not quit with 0 on Ctrl-C"
[ "$(cat "$LOGDIR/small.rc" 2>/dev/null)" = 1 ] && grep -q 'needs 80x24' "$LOGDIR/small.err" ||
  fail "a 60x20 terminal: status $(cat "$LOGDIR/small.rc" 2>/dev/null), $(cat "$LOGDIR/small.err")"
echo "ok: Ctrl-C quits with 0; a 60x20 terminal is refused: $(cat "$LOGDIR/small.err")"

# The record, replayed, fails the same paths in the same order as the live event log.
kill -INT "$REC" "$EVENTS"
wait "$REC" || fail "record: $(cat "$LOGDIR/record.log")"
wait "$EVENTS" || true
"$METAROCE" top --replay "$LOGDIR/run.rec" --speed 1000 -d 0.5 >"$LOGDIR/replay.txt" ||
  fail "top --replay failed"
# Lines both saw (each logs the changes between the snapshots it read; a reader descheduled
# past the engine's 100 ms publication merges two changes into one line) must come in the same
# order, and the failure must be among them.
"$PY" - "$LOGDIR/events.log" "$LOGDIR/replay.txt" <<'PYEOF' || fail "replay and live log differ"
import re, sys
pat = re.compile(r"^\S+ fB .*path \d+ \(plane \d+\): failed .*")
live = [l for l in open(sys.argv[1]).read().splitlines() if pat.match(l)]
replay = list(dict.fromkeys(l for l in open(sys.argv[2]).read().splitlines() if pat.match(l)))
common = set(live) & set(replay)
a = [l for l in live if l in common]
b = [l for l in replay if l in common]
if not a or a != b:
    sys.exit(f"live {len(live)} failures, replay {len(replay)}, {len(common)} in common, same order: {a == b}")
print(f"{len(common)} of {len(live)} live failure lines replayed, in the same order")
PYEOF
echo "ok: the record replays the failures in the order metaroce events logged them"
if command -v gnuplot >/dev/null; then
  "$HERE/../../bench/plot_record" "$LOGDIR/run.rec" -o "$LOGDIR/run.png" >"$LOGDIR/plot.log" 2>&1 ||
    fail "plot_record: $(cat "$LOGDIR/plot.log")"
  [ "$(head -c 4 "$LOGDIR/run.png" | od -An -c | tr -d ' ')" = '211PNG' ] || fail "plot_record wrote no PNG"
  echo "ok: bench/plot_record draws the run"
  # TOP_KEEP=DIR keeps the picture, the record and the panes (docs/operations.md shows them).
  [ -n "${TOP_KEEP:-}" ] && cp "$LOGDIR"/run.png "$LOGDIR"/run.rec "$LOGDIR"/pane-*.txt "$LOGDIR"/record.log "$LOGDIR"/events.log "$TOP_KEEP"/
fi

# The engine dies under a plain-text top: it says so and exits 1, without hanging.
"$METAROCE" top fB -d 0.2 >"$LOGDIR/plain.txt" 2>"$LOGDIR/plain.err" &
TOP=$!
for _ in $(seq 40); do grep -q 'fB>198' "$LOGDIR/plain.txt" && break; sleep 0.25; done
grep -q 'fB>198' "$LOGDIR/plain.txt" || fail "plain top printed no rows: $(cat "$LOGDIR/plain.err")"
LD_PRELOAD= pkill -KILL -f -- "--rundir $METAROCE_RUNDIR( |\$)"
rc=0
timeout 20 tail --pid="$TOP" -f /dev/null || fail "top did not exit when the engine died"
wait "$TOP" || rc=$?
[ "$rc" = 1 ] && grep -q 'any more' "$LOGDIR/plain.err" ||
  fail "top exited $rc when the engine died: $(cat "$LOGDIR/plain.err")"
echo "ok: top exits 1 when the engine dies: $(cat "$LOGDIR/plain.err")"
