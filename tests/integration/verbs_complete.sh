#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The second round of verbs over one MetaRoCE device with our verbs_complete program: memory
# (IOVA, implicit ODP, advise, dmabuf, rereg, relaxed ordering, ECE, resize CQ, windows), thread
# and parent domains,
# port events while the link's port is taken down and up, by the operator (link set --plane)
# and by its memif peer going away and coming back, and imported contexts, PDs and MRs with the
# engine killed under them.
source "$(dirname "$0")/lib.sh"
PROG="$BUILD/tests/integration/verbs_complete"
[ -x "$PROG" ] || fail "$PROG is not built"
make_pair
timeout 60 "$PROG" --dev mrA --test memory >"$LOGDIR/memory" 2>&1 ||
  { cat "$LOGDIR/memory"; fail "memory"; }
timeout 60 "$PROG" --dev mrA --test domains >"$LOGDIR/domains" 2>&1 ||
  { cat "$LOGDIR/domains"; fail "domains"; }

# wait_for LINE: until the port program printed LINE (30 s at most).
wait_for() {
  for _ in $(seq 300); do
    grep -qx "$1" "$LOGDIR/port" && return 0
    kill -0 "$PORT_PID" 2>/dev/null ||
      { cat "$LOGDIR/port"; fail "the port program exited before '$1'"; }
    sleep 0.1
  done
  cat "$LOGDIR/port"
  fail "no '$1' from the port program"
}
timeout 120 "$PROG" --dev mrA --test port >"$LOGDIR/port" 2>&1 &
PORT_PID=$!
PIDS+=("$PORT_PID")
wait_for ready
"$METAROCE" link set mrA --plane 0 down >/dev/null
wait_for "down 0"
"$METAROCE" link set mrA --plane 0 up >/dev/null
wait_for "up 0"
"$METAROCE" link del mrB >/dev/null
wait_for "down 1"
"$METAROCE" link add mrB --dpdk "net_memif1,role=client,socket=metaroce-$TEST_NAME-$$" \
  --ip 198.18.0.2/24 >/dev/null
wait_for "up 1"
wait "$PORT_PID" || { cat "$LOGDIR/port"; fail "port events"; }

# Imports (ibv_import_device/pd/mr), last: it ends with the engine killed under them.
timeout 90 "$PROG" --dev mrA --test import >"$LOGDIR/import" 2>&1 &
IMPORT_PID=$!
PIDS+=("$IMPORT_PID")
for _ in $(seq 600); do
  grep -qx ready "$LOGDIR/import" && break
  kill -0 "$IMPORT_PID" 2>/dev/null || break
  sleep 0.1
done
grep -qx ready "$LOGDIR/import" || { cat "$LOGDIR/import"; fail "import: no 'ready'"; }
LD_PRELOAD= timeout 10 pkill -KILL -f -- "metaroced.*--rundir $METAROCE_RUNDIR( |\$)" ||
  fail "no engine to kill"
wait "$IMPORT_PID" || { cat "$LOGDIR/import"; fail "import"; }
echo "PASS verbs_complete"
