#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Our NCCL-pattern program between two processes over memif: zero-SGE receives, CTS slots
# written into the sender's fifo and spun on without verbs calls, data split over 4 QPs as
# chained unsignaled WRITEs plus a signaled WRITE_WITH_IMM; every byte checked. Then once with
# one QP and small messages (many more iterations, the fifo round trip dominates).
source "$(dirname "$0")/lib.sh"
PROG="$BUILD/tests/integration/nccl_pattern"
[ -x "$PROG" ] || fail "$PROG is not built"
make_pair
port=18700
run_pair nccl_4qp $port 180 -- "$PROG" --dev mrA --server --port $port --qps 4 --iters 300 --size 1048576 \
  -- "$PROG" --dev mrB --connect 127.0.0.1 --port $port --qps 4 --iters 300 --size 1048576
grep -q 'all checks passed' "$LOGDIR/nccl_4qp.server" || fail "4 QPs: receiver did not pass"
run_pair nccl_1qp $((port + 1)) 180 -- "$PROG" --dev mrA --server --port $((port + 1)) --qps 1 --iters 3000 --size 8192 \
  -- "$PROG" --dev mrB --connect 127.0.0.1 --port $((port + 1)) --qps 1 --iters 3000 --size 8192
grep -q 'all checks passed' "$LOGDIR/nccl_1qp.server" || fail "1 QP: receiver did not pass"
cat "$LOGDIR/nccl_4qp.server" "$LOGDIR/nccl_4qp.client" "$LOGDIR/nccl_1qp.client"
echo "PASS nccl_pattern"
