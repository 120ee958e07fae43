#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Open MPI 4.1 (Debian 12) with pml ucx and osc ucx over MetaRoCE, the way Open MPI uses any
# RDMA device: mpi_check (every byte of ping-pongs from 1 B to 4 MiB, MPI_Allreduce,
# MPI_Alltoall, MPI_Put and MPI_Get) over 2 ranks on 2 devices and 4 ranks sharing them; then a
# rank killed with SIGKILL mid-run: the job ends with an error, not a hang, and the engine holds
# nothing of any rank afterwards.
source "$(dirname "$0")/../integration/lib.sh"
command -v mpirun >/dev/null || { echo "SKIP: mpirun (openmpi-bin) is not installed"; exit 77; }
PROG="$BUILD/tests/clients/mpi_check"
[ -x "$PROG" ] || { echo "SKIP: mpi_check is not built (libopenmpi-dev)"; exit 77; }
make_pair

# Even ranks on mrA, odd ranks on mrB.
rankdev="$METAROCE_RUNDIR/rankdev"
cat >"$rankdev" <<'SH'
#!/bin/sh
if [ $((${OMPI_COMM_WORLD_RANK:-0} % 2)) -eq 0 ]; then dev=mrA:1; else dev=mrB:1; fi
UCX_NET_DEVICES=$dev exec "$@"
SH
chmod +x "$rankdev"
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --bind-to none --mca pml ucx --mca osc ucx
        --mca btl self -x UCX_TLS=rc_verbs,ud_verbs,self -x SYSFS_PATH -x LD_PRELOAD
        -x RDMAV_DRIVERS -x METAROCE_RUNDIR)

# no_contexts WHAT: the engine holds no context (every rank's released) within 5 s.
no_contexts() {
  for _ in $(seq 50); do [ "$(engine_count contexts)" -eq 0 ] && return 0; sleep 0.1; done
  fail "$1: the engine still holds $(engine_count contexts) contexts"
}

for np in 2 4; do
  before=$(stat_counter mrB tx_packets)
  rc=0
  timeout 300 "${MPIRUN[@]}" -np $np "$rankdev" "$PROG" >"$LOGDIR/mpi$np" 2>&1 || rc=$?
  [ "$rc" -eq 0 ] && grep -q "mpi_check: $np ranks, all checks passed" "$LOGDIR/mpi$np" ||
    { tail -n 30 "$LOGDIR/mpi$np"; fail "mpi_check over $np ranks: exit $rc"; }
  sleep 0.3  # stat is published every 100 ms
  sent=$(( $(stat_counter mrB tx_packets) - before ))
  # 4 MiB each way and back at least: over 2,000 packets of 4 KiB left mrB.
  [ "$sent" -gt 2000 ] || fail "mpi_check over $np ranks sent $sent packets on mrB: not over MetaRoCE"
  echo "mpi_check over $np ranks: every byte checked, $sent packets out of mrB"
  no_contexts "after $np ranks"
done

echo "== a rank killed mid-run"
timeout 120 "${MPIRUN[@]}" -np 4 "$rankdev" "$PROG" --run 60 >"$LOGDIR/killed" 2>&1 &
job=$!
PIDS+=("$job")
victim=""
for _ in $(seq 300); do
  victim=$(sed -n 's/^rank 1 pid \([0-9]*\) running$/\1/p' "$LOGDIR/killed")
  [ -n "$victim" ] && [ "$(grep -c ' running$' "$LOGDIR/killed")" -eq 4 ] && break
  kill -0 "$job" 2>/dev/null || { cat "$LOGDIR/killed"; fail "the job ended before it ran"; }
  sleep 0.1
done
[ -n "$victim" ] || fail "rank 1 never said it was running"
sleep 1
kill -9 "$victim"
start=$(date +%s)
rc=0
wait "$job" || rc=$?
[ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] ||
  { tail -n 20 "$LOGDIR/killed"; fail "a job with a killed rank exited $rc (124: it hung)"; }
echo "the job ended with exit $rc $(( $(date +%s) - start )) s after rank 1 was killed"
no_contexts "after the killed rank's job"
"$METAROCE" engine status | grep -q "0 context" || fail "engine status after the job"
