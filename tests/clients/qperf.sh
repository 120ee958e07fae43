#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# qperf (Debian's qperf package) over MetaRoCE: its RC tests through the RDMA CM (-cm1), SEND,
# WRITE, READ and atomics, bandwidth and latency. qperf reaches its server over TCP at the
# address it then gives the RDMA CM, so it runs in a namespace where a veth interface holds the
# devices' addresses (addr_ns.sh). qperf's UD tests and its RC tests without -cm1 address the
# peer by LID alone, which no RoCE device accepts: ibv_modify_qp / ibv_create_ah fail with
# EINVAL, as on mlx5 (docs/spec/verbs-mapping.md §7).
source "$(dirname "$0")/../integration/lib.sh"
command -v qperf >/dev/null || { echo "SKIP: qperf is not installed"; exit 77; }
make_pair
source "$(dirname "$0")/addr_ns.sh"
port=19770
run_in_ns timeout 120 qperf -lp $port >"$LOGDIR/qperf.server" 2>&1 &
PIDS+=($!)
ns_wait_listen $port
tests=(rc_bw rc_lat rc_rdma_write_bw rc_rdma_write_lat rc_rdma_read_bw rc_rdma_read_lat
       rc_compare_swap_mr rc_fetch_add_mr)
rc=0
run_in_ns timeout 120 qperf 198.18.0.1 -lp $port -cm1 -t 1 "${tests[@]}" \
  >"$LOGDIR/qperf.client" 2>&1 || rc=$?
cat "$LOGDIR/qperf.client"
[ "$rc" -eq 0 ] || fail "qperf exited $rc"
grep -qi "fail\|error" "$LOGDIR/qperf.client" && fail "qperf reported an error"
figures=$(grep -cE '^ +(bw|latency|msg_rate) += ' "$LOGDIR/qperf.client" || true)
[ "$figures" -eq "${#tests[@]}" ] || fail "qperf printed $figures figures for ${#tests[@]} tests"
echo "qperf: ${#tests[@]} RC tests through the RDMA CM"
