#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Registered memory of every kind (docs/design.md, "Shared memory regions"): our mr_memory
# program with the pages shared, with them reached by system call (METAROCE_SHARED_MR=0), and
# with libibverbs' fork protection (RDMAV_FORK_SAFE=1); ibv_rc_pingpong both ways; then a
# process SIGKILLed mid-transfer with its regions registered: the engine reclaims its context and
# unmaps its shared pages, and serves the next program.
source "$(dirname "$0")/lib.sh"
make_pair
prog="$BUILD/tests/integration/mr_memory"
run() {  # NAME ENV...: mr_memory under the given environment
  local name=$1
  shift
  env "$@" timeout 120 "$prog" --a mrA --b mrB --metaroce "$METAROCE" >"$LOGDIR/$name" 2>&1 ||
    { cat "$LOGDIR/$name"; fail "mr_memory ($name)"; }
  sed "s/^/$name: /" "$LOGDIR/$name"
}
# A 2 MiB page for the hugetlbfs case, where one can be reserved (put back after).
HUGE=/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages
huge_reserved=""
if [ -w "$HUGE" ] && [ "$(cat "$HUGE")" = 0 ] && echo 2 >"$HUGE" 2>/dev/null; then
  huge_reserved=1
  trap 'rc=$?; set +e; echo 0 >"$HUGE" 2>/dev/null; (exit $rc); cleanup' EXIT
fi
run shared METAROCE_SHARED_MR=1
run syscall METAROCE_SHARED_MR=0
run forksafe METAROCE_SHARED_MR=1 RDMAV_FORK_SAFE=1
[ -n "$huge_reserved" ] && echo 0 >"$HUGE" 2>/dev/null || true
# A read of memory the application unmapped is counted where B's engine sees it.
[ "$(stat_counter mrB memory_faults)" -gt 0 ] || fail "no memory fault counted on mrB"
grep -q "ok unaligned region" "$LOGDIR/shared" || fail "mr_memory did not run its cases"

port=18660
for share in 1 0; do
  run_pair "pingpong$share" $port 60 -- env METAROCE_SHARED_MR=$share ibv_rc_pingpong -d mrA -g 0 -p $port -s 65536 -n 200 -c \
    -- env METAROCE_SHARED_MR=$share ibv_rc_pingpong -d mrB -g 0 -p $port -s 65536 -n 200 -c 127.0.0.1
  port=$((port + 1))
done

# SIGKILL mid-transfer with shared regions: no context, no mapping of its pages left.
engine=$("$METAROCE" engine status --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["pid"])')
METAROCE_SHARED_MR=1 timeout 60 ib_write_bw -d mrA -x 0 -p $port -s 65536 -D 8 >"$LOGDIR/kill.server" 2>&1 &
server=$!
PIDS+=($server)
wait_listen $port
METAROCE_SHARED_MR=1 timeout 60 ib_write_bw -d mrB -x 0 -p $port -s 65536 -D 8 127.0.0.1 >"$LOGDIR/kill.client" 2>&1 &
client=$!
PIDS+=($client)
for _ in $(seq 100); do
  [ "$(grep -c memfd:metaroce-mr "/proc/$engine/maps")" -ge 2 ] && break
  sleep 0.1
done
[ "$(grep -c memfd:metaroce-mr "/proc/$engine/maps")" -ge 2 ] || fail "the engine maps no shared pages of ib_write_bw"
sleep 1
# (procps deadlocks under a sanitizer's preloaded runtime: not there.)
victim=$(LD_PRELOAD= pgrep -P $client ib_write_bw) || fail "no ib_write_bw under timeout"
kill -9 "$victim"
wait $client 2>/dev/null || true
wait $server 2>/dev/null || true  # its peer gone, the server ends (error or timeout)
for _ in $(seq 100); do
  [ "$(engine_count contexts)" -eq 0 ] && [ "$(grep -c memfd:metaroce-mr "/proc/$engine/maps")" -eq 0 ] && break
  sleep 0.1
done
[ "$(engine_count contexts)" -eq 0 ] || fail "contexts left after the kill"
[ "$(grep -c memfd:metaroce-mr "/proc/$engine/maps")" -eq 0 ] ||
  { grep memfd:metaroce-mr "/proc/$engine/maps"; "$METAROCE" engine status; fail "the engine still maps a dead process's pages"; }
run_pair after_kill $((port + 1)) 60 -- ibv_rc_pingpong -d mrA -g 0 -p $((port + 1)) -n 100 -c \
  -- ibv_rc_pingpong -d mrB -g 0 -p $((port + 1)) -n 100 -c 127.0.0.1
echo "PASS mr_memory"
