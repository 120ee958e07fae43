#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# One engine, every process (issue 9): many processes hold the same devices while others run
# traffic over them; every rank opens every device; a process killed mid-transfer leaves its
# peers and the engine clean; an engine killed mid-transfer reaches every application as
# IBV_EVENT_DEVICE_FATAL and error completions, and a restarted engine serves new programs.
source "$(dirname "$0")/lib.sh"
make_pair
RANKS="$BUILD/tests/integration/ranks"
port=18940

# contexts_of PID: how many device contexts the engine serves for process PID.
contexts_of() {
  "$METAROCE" engine status --json | /usr/bin/python3 -c \
    'import json,sys; print(sum(1 for c in json.load(sys.stdin)["contexts"] if c["pid"] == int(sys.argv[1])))' "$1"
}
contexts() { engine_count contexts; }

echo "== eight holders, two ib_write_bw pairs and ibv_devinfo on the same two devices"
holders=()
for i in $(seq 8); do
  timeout 60 "$RANKS" --hold 40 --open-all >"$LOGDIR/hold$i" 2>&1 &
  holders+=($!)
  PIDS+=($!)
done
for _ in $(seq 100); do [ "$(contexts)" -ge 16 ] && break; sleep 0.1; done
[ "$(contexts)" -ge 16 ] || fail "the engine serves $(contexts) contexts, not the 16 of 8 holders x 2 devices"
bw=()
for p in $port $((port + 1)); do
  timeout 60 ib_write_bw -d mrA -x 0 -p $p -s 65536 -D 4 >"$LOGDIR/bw$p.server" 2>&1 &
  PIDS+=($!)
  bw+=($!)
done
for p in $port $((port + 1)); do wait_listen $p; done
for p in $port $((port + 1)); do
  timeout 60 ib_write_bw -d mrB -x 0 -p $p -s 65536 -D 4 127.0.0.1 >"$LOGDIR/bw$p.client" 2>&1 &
  PIDS+=($!)
  bw+=($!)
done
sleep 2.5
timeout 20 ibv_devinfo -d mrA >"$LOGDIR/devinfo.A" 2>&1 || fail "ibv_devinfo -d mrA failed beside the traffic"
timeout 20 ibv_devinfo -d mrB >"$LOGDIR/devinfo.B" 2>&1 || fail "ibv_devinfo -d mrB failed beside the traffic"
grep -q PORT_ACTIVE "$LOGDIR/devinfo.A" || fail "ibv_devinfo does not show mrA active"
"$METAROCE" stat mrB --json >"$LOGDIR/stat.json"
for pid in "${bw[@]}"; do wait "$pid" || fail "an ib_write_bw beside the holders failed (pid $pid)"; done
qpns=$(grep -ho 'local address: LID [0-9a-fx]* QPN 0x[0-9a-f]*' "$LOGDIR"/bw*.client | sed 's/.*QPN //')
/usr/bin/python3 - "$LOGDIR/stat.json" $qpns <<'PY' || fail "stat does not show both pairs' QPs as streams of one connection"
import json, sys
d = json.load(open(sys.argv[1]))
want = {int(q, 16) for q in sys.argv[2:]}
assert len(want) == 2, f"client QPNs {sys.argv[2:]}"
conns = [c for c in d["connections"] if c["peer"] == "198.18.0.1"]
assert len(conns) == 1, f"{len(conns)} connections to 198.18.0.1"
streams = {s["qpn"] for s in conns[0]["streams"]}
assert want <= streams, f"streams {sorted(streams)} lack client QPs {sorted(want)}"
pids = {s["pid"] for s in conns[0]["streams"] if s["qpn"] in want}
assert len(pids) == 2, f"the two client QPs belong to processes {pids}"
print(f"one connection to 198.18.0.1 carries streams {sorted(streams)} of processes {sorted(pids)}")
PY
for pid in "${holders[@]}"; do kill -TERM "$pid"; done
for pid in "${holders[@]}"; do wait "$pid" || fail "a holder exited $? (expected 0)"; done
for _ in $(seq 50); do [ "$(contexts)" -eq 0 ] && break; sleep 0.1; done
[ "$(contexts)" -eq 0 ] || fail "the engine still serves $(contexts) contexts after every process closed"

echo "== every rank opens every device: four ranks, two pairs, every byte checked"
port=$((port + 2))
run_pair ranks01 $port 60 -- "$RANKS" --open-all --dev mrA --server --port $port --seconds 3 --size 32768 \
  -- "$RANKS" --open-all --dev mrB --connect 127.0.0.1 --port $port --seconds 3 --size 32768 &
first=$!
run_pair ranks23 $((port + 1)) 60 -- "$RANKS" --open-all --dev mrA --server --port $((port + 1)) --seconds 3 --size 4096 \
  -- "$RANKS" --open-all --dev mrB --connect 127.0.0.1 --port $((port + 1)) --seconds 3 --size 4096
wait $first || fail "the first pair of ranks failed"
grep -h 'bytes checked' "$LOGDIR"/ranks*.client

echo "== SIGKILL of a process mid-transfer"
port=$((port + 2))
# Pair X streams WRITEs into a receiver that is killed; pair Y runs checked traffic meanwhile.
# (The victim runs without `timeout` so that $! is its own pid; it bounds itself.)
"$RANKS" --dev mrA --server --port $port --stream --seconds 20 >"$LOGDIR/x.server" 2>&1 &
victim=$!
PIDS+=($victim)
wait_listen $port
timeout 60 "$RANKS" --dev mrB --connect 127.0.0.1 --port $port --stream --seconds 20 --timeout 14 \
  >"$LOGDIR/x.client" 2>&1 &
writer=$!
PIDS+=($writer)
timeout 60 "$RANKS" --dev mrA --server --port $((port + 1)) --seconds 5 >"$LOGDIR/y.server" 2>&1 &
ys=$!
PIDS+=($ys)
wait_listen $((port + 1))
timeout 60 "$RANKS" --dev mrB --connect 127.0.0.1 --port $((port + 1)) --seconds 5 >"$LOGDIR/y.client" 2>&1 &
yc=$!
PIDS+=($yc)
sleep 1.5
[ "$(contexts_of $victim)" -ge 1 ] || fail "the engine serves no context of the victim before the kill"
kill -KILL $victim
killed_at=$(date +%s%N)
# The engine reclaims the killed process at once: within a second it holds nothing of it.
reclaimed=""
for _ in $(seq 20); do
  if [ "$(contexts_of $victim)" -eq 0 ]; then reclaimed=$(( ($(date +%s%N) - killed_at) / 1000000 )); break; fi
  sleep 0.05
done
[ -n "$reclaimed" ] || fail "the engine still holds objects of killed process $victim after a second"
grep -q 'opened 1 device' "$LOGDIR/x.server" || fail "the victim had not opened its device"
echo "objects of the killed process reclaimed within ${reclaimed} ms"
rc=0
wait $writer || rc=$?
[ "$rc" -eq 3 ] || fail "the killed receiver's peer exited $rc (expected 3: an error completion); $(cat "$LOGDIR/x.client")"
grep -q 'status=12 ' "$LOGDIR/x.client" || fail "the peer's error is not IBV_WC_RETRY_EXC_ERR: $(cat "$LOGDIR/x.client")"
# QP timeout 14: 67 ms, 7 retries: the error comes within about half a second of silence.
ms=$(sed -n 's/.* \([0-9]*\) ms after the last progress.*/\1/p' "$LOGDIR/x.client")
[ "$ms" -le 5000 ] || fail "the peer's error came $ms ms after its last progress"
echo "peer of the killed process: $(grep ERROR_COMPLETION "$LOGDIR/x.client")"
wait $yc || fail "the other pair's client failed: $(cat "$LOGDIR/y.client")"
wait $ys || fail "the other pair's server failed: $(cat "$LOGDIR/y.server")"
grep -h 'bytes checked' "$LOGDIR/y.client"

echo "== the engine killed mid-transfer"
port=$((port + 2))
timeout 60 "$RANKS" --hold 60 --open-all >"$LOGDIR/holder.fatal" 2>&1 &
holder=$!
PIDS+=($holder)
timeout 60 "$RANKS" --dev mrA --server --port $port --seconds 30 >"$LOGDIR/f.server" 2>&1 &
fs=$!
PIDS+=($fs)
wait_listen $port
timeout 60 "$RANKS" --dev mrB --connect 127.0.0.1 --port $port --seconds 30 >"$LOGDIR/f.client" 2>&1 &
fc=$!
PIDS+=($fc)
sleep 1.5
engine=$("$METAROCE" engine status --json | /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["pid"])')
kill -KILL "$engine"
for pid in $fs $fc $holder; do
  rc=0
  wait $pid || rc=$?
  [ "$rc" -eq 4 ] || fail "process $pid exited $rc after the engine died (expected 4: DEVICE_FATAL)"
done
grep -q 'DEVICE_FATAL' "$LOGDIR/f.client" && grep -q 'DEVICE_FATAL' "$LOGDIR/f.server" ||
  fail "the ranks did not see IBV_EVENT_DEVICE_FATAL"
grep -h ERROR_COMPLETION "$LOGDIR"/f.*
"$METAROCE" engine start || fail "a new engine did not start"
run_pair after $((port + 1)) 60 -- ibv_rc_pingpong -g 0 -d mrA -p $((port + 1)) -n 100 \
  -- ibv_rc_pingpong -g 0 -d mrB -p $((port + 1)) -n 100 127.0.0.1
echo "PASS host_engine"
