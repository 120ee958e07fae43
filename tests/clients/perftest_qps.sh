#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# perftest with many QPs: ib_write_bw -q 1024 asks one CQ of 128 x 1024 entries (over the 65,536
# MetaRoCE offered before max_cqe became ConnectX's 2^22 - 1) and 1024 QPs of one process, each
# a stream of the devices' one connection; ib_send_bw -q 256 posts receives on every one.
source "$(dirname "$0")/../integration/lib.sh"
make_pair
run_pair write_q1024 18810 240 -- \
  ib_write_bw -d mrA -x 0 -q 1024 -s 4096 -n 100 -p 18810 -- \
  ib_write_bw -d mrB -x 0 -q 1024 -s 4096 -n 100 -p 18810 127.0.0.1
grep -E '^ *4096 +102400 ' "$LOGDIR/write_q1024.client" ||
  fail "ib_write_bw -q 1024 printed no result line for 1024 x 100 iterations"
run_pair send_q256 18811 240 -- \
  ib_send_bw -d mrA -x 0 -q 256 -s 4096 -n 100 -p 18811 -- \
  ib_send_bw -d mrB -x 0 -q 256 -s 4096 -n 100 -p 18811 127.0.0.1
grep -E '^ *4096 +25600 ' "$LOGDIR/send_q256.client" ||
  fail "ib_send_bw -q 256 printed no result line for 256 x 100 iterations"
