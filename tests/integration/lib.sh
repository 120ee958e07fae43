# SPDX-License-Identifier: Apache-2.0
# Shared helpers of the integration tests: a private run directory with two MetaRoCE devices
# joined by a DPDK memif link (both served by the run dir's engine, which `link add` starts and
# the cleanup stops), and a way to run a server/client pair of unmodified programs.
# Sourced by the tests; $1 of every test is the build directory.
set -euo pipefail

BUILD=$(cd "${1:?usage: $0 BUILD_DIR}" && pwd)
METAROCE="$BUILD/util/metaroce"
TEST_NAME=$(basename "$0" .sh)
export METAROCE_RUNDIR
METAROCE_RUNDIR=$(mktemp -d "/tmp/metaroce-$TEST_NAME.XXXXXX")
LOGDIR="$METAROCE_RUNDIR/logs"
mkdir -p "$LOGDIR"
PIDS=()
# A sanitized build's runtime (tests/integration/meson.build preloads it): what a program run
# without `metaroce env`'s LD_PRELOAD must still have.
SAN_PRELOAD=${LD_PRELOAD:-}

cleanup() {
  local rc=$?
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if [ "$rc" -ne 0 ]; then
    echo "--- logs of $TEST_NAME (rundir $METAROCE_RUNDIR) ---"
    for f in "$LOGDIR"/*; do [ -f "$f" ] && { echo "== $f"; tail -n 40 "$f"; }; done
  fi
  for d in $("$METAROCE" link show --json 2>/dev/null | grep -o '"name": *"[^"]*"' | sed 's/.*"\([^"]*\)"$/\1/'); do
    "$METAROCE" link del "$d" >/dev/null 2>&1 || true
  done
  "$METAROCE" engine stop >/dev/null 2>&1 || true
  # An engine the CLI could not stop (the CLI itself failing, say) goes with its run dir. Not
  # under a sanitizer's preloaded runtime: procps' pkill deadlocks in it.
  LD_PRELOAD= timeout 10 pkill -f -- "--rundir $METAROCE_RUNDIR( |\$)" 2>/dev/null || true
  if [ "$rc" -ne 0 ] && [ -f "$METAROCE_RUNDIR/engine.log" ]; then
    echo "== engine log"
    # A sanitizer's report whole (it starts the trouble), else the end.
    if grep -q 'Sanitizer' "$METAROCE_RUNDIR/engine.log"; then
      sed -n '/\(WARNING\|ERROR\): .*Sanitizer\|runtime error/,$p' "$METAROCE_RUNDIR/engine.log" | head -n 120
    else
      tail -n 40 "$METAROCE_RUNDIR/engine.log"
    fi
  fi
  rm -rf "$METAROCE_RUNDIR"
  exit "$rc"
}
trap cleanup EXIT

fail() { echo "FAIL $TEST_NAME: $*" >&2; exit 1; }

# stat_counter DEV NAME: a device counter from `metaroce stat --json` (published every 100 ms).
stat_counter() {
  "$METAROCE" stat "$1" --json | python3 -c '
import json, sys
print(json.load(sys.stdin)["counters"].get(sys.argv[1], 0))' "$2"
}

# engine_count contexts|cm_ids: how many device contexts (or RDMA CM ids) the engine serves.
engine_count() {
  "$METAROCE" engine status --json | python3 -c '
import json, sys
v = json.load(sys.stdin)[sys.argv[1]]
print(len(v) if isinstance(v, list) else v)' "$1"
}

# wait_cm_listener: until the engine holds an RDMA CM id (a server listening through the CM
# alone, with no TCP port to wait for), 10 s at most.
wait_cm_listener() {
  for _ in $(seq 100); do
    [ "$(engine_count cm_ids)" -gt 0 ] && return 0
    sleep 0.1
  done
  fail "no RDMA CM id appeared in the engine"
}

# make_pair [extra link options]: devices mrA (memif server) and mrB (memif client).
make_pair() {
  local sock="metaroce-$TEST_NAME-$$"
  "$METAROCE" link add mrA --dpdk "net_memif0,role=server,socket=$sock" --ip 198.18.0.1/24 "$@"
  "$METAROCE" link add mrB --dpdk "net_memif1,role=client,socket=$sock" --ip 198.18.0.2/24 "$@"
  eval "$("$METAROCE" env)"
}

# fabric_pair FAB PLANES LINKS SEED [fabric options]: a 2-endpoint fabric emulator FAB (pid in
# FABRIC_PID) and the devices fA (endpoint 0) and fB (endpoint 1) on it.
FABRIC_PID=""
FAULT_PID=""
fabric_pair() {
  local fab=$1 planes=$2 links=$3 seed=$4
  shift 4
  timeout -s INT 900 "$METAROCE" fabric run "$fab" --endpoints 2 --planes "$planes" \
    --links-per-plane "$links" --seed "$seed" "$@" >"$LOGDIR/fabric.log" 2>&1 &
  FABRIC_PID=$!
  PIDS+=("$FABRIC_PID")
  for _ in $(seq 150); do
    [ -S "$METAROCE_RUNDIR/fabric/$fab/control" ] && [ -f "$METAROCE_RUNDIR/fabric/$fab/pid" ] && break
    kill -0 "$FABRIC_PID" 2>/dev/null || fail "fabric run exited early: $(cat "$LOGDIR/fabric.log")"
    sleep 0.1
  done
  "$METAROCE" link add fA --fabric "$fab:0" --ip 198.18.0.1/24 >/dev/null
  "$METAROCE" link add fB --fabric "$fab:1" --ip 198.18.0.2/24 >/dev/null
  eval "$("$METAROCE" env)"
}

# fabric_pair_stop FAB: the fault process (FAULT_PID) if any, both devices, the fabric.
fabric_pair_stop() {
  [ -n "$FAULT_PID" ] && { kill "$FAULT_PID" 2>/dev/null || true; wait "$FAULT_PID" 2>/dev/null || true; }
  FAULT_PID=""
  "$METAROCE" link del fA >/dev/null 2>&1 || true
  "$METAROCE" link del fB >/dev/null 2>&1 || true
  if [ -n "$FABRIC_PID" ]; then
    "$METAROCE" fabric stop "$1" >/dev/null 2>&1 || kill "$FABRIC_PID" 2>/dev/null || true
    wait "$FABRIC_PID" 2>/dev/null || true
  fi
  FABRIC_PID=""
}

# wait_listen PORT: until a TCP listener is up on PORT (10 s at most).
wait_listen() {
  for _ in $(seq 100); do
    ss -ltnH "sport = :$1" 2>/dev/null | grep -q . && return 0
    sleep 0.1
  done
  fail "nothing listens on TCP port $1"
}

# run_pair NAME PORT TIMEOUT -- SERVER_CMD... -- CLIENT_CMD...
# Runs the server, waits for its TCP port, runs the client; both must exit 0 within TIMEOUT s.
run_pair() {
  local name=$1 port=$2 limit=$3
  shift 3
  [ "$1" = "--" ] && shift
  local server=() client=()
  while [ "$1" != "--" ]; do server+=("$1"); shift; done
  shift
  client=("$@")
  local attempt crc src
  for attempt in 1 2; do
    timeout "$limit" "${server[@]}" >"$LOGDIR/$name.server" 2>&1 &
    local spid=$!
    PIDS+=("$spid")
    wait_listen "$port"
    crc=0
    timeout "$limit" "${client[@]}" >"$LOGDIR/$name.client" 2>&1 || crc=$?
    src=0
    wait "$spid" || src=$?
    [ "$crc" -eq 0 ] && [ "$src" -eq 0 ] && return 0
    # perftest times its report with a CPU clock it calibrates against gettimeofday at the
    # end; on a loaded 2-core host that calibration can fail ("Correlation coefficient r^2 <
    # 0.9", then "Can't produce a report", exit 1) after a transfer that went well. That is
    # the host, not the transport: run the pair once more. Any other failure fails at once.
    grep -qs "Correlation coefficient r^2" "$LOGDIR/$name.server" "$LOGDIR/$name.client" || break
    echo "note: $name: perftest could not calibrate its clock under load; running it again"
  done
  echo "== $name server (exit $src)"; tail -n 30 "$LOGDIR/$name.server"
  echo "== $name client (exit $crc)"; tail -n 30 "$LOGDIR/$name.client"
  # The programs' own words on the FAIL line: cleanup prints every log after this one, and a
  # CI summary keeps only the end of the output.
  local why
  why=$(grep -h -i -E 'error|fail|couldn.t|exceeded|unable' "$LOGDIR/$name.client" \
    "$LOGDIR/$name.server" | head -n 3 | tr -s ' \t\n' ' ')
  fail "$name: server exit $src, client exit $crc${why:+: $why}"
}
