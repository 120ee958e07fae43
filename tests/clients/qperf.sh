#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# qperf (Debian's qperf package) over MetaRoCE: its RC tests through the RDMA CM (-cm1), SEND,
# WRITE, READ and atomics, bandwidth and latency. qperf reaches its server over TCP at the
# same address it then gives the RDMA CM, so the test runs it in a network namespace of its
# own where a veth interface holds the devices' addresses; the RDMA traffic goes through the
# engine as always. qperf's UD tests and its RC tests without -cm1 address the peer by LID
# alone, which no RoCE device accepts: ibv_modify_qp / ibv_create_ah fail with EINVAL, as on
# mlx5 (docs/spec/verbs-mapping.md §7).
source "$(dirname "$0")/../integration/lib.sh"
command -v qperf >/dev/null || { echo "SKIP: qperf is not installed"; exit 77; }
make_pair
NS="mrq$$"
trap 'rc=$?; ip netns del "$NS" 2>/dev/null; (exit $rc); cleanup' EXIT
ip netns add "$NS" || { echo "SKIP: no network namespaces here"; exit 77; }
ip -n "$NS" link set lo up
ip -n "$NS" link add va type veth peer name vb
ip -n "$NS" link set va up
ip -n "$NS" link set vb up
ip -n "$NS" addr add 198.18.0.1/32 dev va
ip -n "$NS" addr add 198.18.0.2/32 dev va
port=19770
ip netns exec "$NS" timeout 120 qperf -lp $port >"$LOGDIR/qperf.server" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do
  ip netns exec "$NS" ss -ltnH "sport = :$port" | grep -q . && break
  sleep 0.1
done
tests=(rc_bw rc_lat rc_rdma_write_bw rc_rdma_write_lat rc_rdma_read_bw rc_rdma_read_lat
       rc_compare_swap_mr rc_fetch_add_mr)
rc=0
ip netns exec "$NS" timeout 120 qperf 198.18.0.1 -lp $port -cm1 -t 1 "${tests[@]}" \
  >"$LOGDIR/qperf.client" 2>&1 || rc=$?
cat "$LOGDIR/qperf.client"
[ "$rc" -eq 0 ] || fail "qperf exited $rc"
grep -qi "fail\|error" "$LOGDIR/qperf.client" && fail "qperf reported an error"
figures=$(grep -cE '^ +(bw|latency|msg_rate) += ' "$LOGDIR/qperf.client" || true)
[ "$figures" -eq "${#tests[@]}" ] || fail "qperf printed $figures figures for ${#tests[@]} tests"
echo "qperf: ${#tests[@]} RC tests through the RDMA CM"
