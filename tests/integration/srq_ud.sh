#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Shared receive queues and UD datagrams with unmodified programs between two processes over
# memif: ibv_srq_pingpong (16 QPs on one SRQ, -c checks the bytes), ibv_ud_pingpong (GRH in the
# receive buffer, address handles), and perftest's ib_send_bw --use-srq, UD ib_send_{bw,lat}, and
# UD on an SRQ.
source "$(dirname "$0")/lib.sh"
make_pair
port=18660
run_pair srq_pingpong $port 90 -- ibv_srq_pingpong -g 0 -d mrA -p $port -n 200 -c \
  -- ibv_srq_pingpong -g 0 -d mrB -p $port -n 200 -c 127.0.0.1
grep -q '200 iters in' "$LOGDIR/srq_pingpong.client" || fail "srq_pingpong: no 200 round trips on its 16 QPs"
run_pair ud_pingpong $((port + 1)) 60 -- ibv_ud_pingpong -g 0 -d mrA -p $((port + 1)) -s 1024 -n 500 -c \
  -- ibv_ud_pingpong -g 0 -d mrB -p $((port + 1)) -s 1024 -n 500 -c 127.0.0.1
grep -q '1024000 bytes in' "$LOGDIR/ud_pingpong.client" || fail "ud_pingpong: no 500 round trips"
run_pair send_bw_srq $((port + 2)) 120 -- ib_send_bw -x 0 -d mrA -p $((port + 2)) -n 2000 --use-srq \
  -- ib_send_bw -x 0 -d mrB -p $((port + 2)) -n 2000 --use-srq 127.0.0.1
grep -qE '^ *65536 +2000' "$LOGDIR/send_bw_srq.client" || fail "ib_send_bw --use-srq reported no result"
run_pair send_bw_srq_q4 $((port + 3)) 120 -- ib_send_bw -x 0 -d mrA -p $((port + 3)) -n 1000 -q 4 --use-srq \
  -- ib_send_bw -x 0 -d mrB -p $((port + 3)) -n 1000 -q 4 --use-srq 127.0.0.1
grep -qE '^ *65536 +4000' "$LOGDIR/send_bw_srq_q4.client" || fail "ib_send_bw -q 4 --use-srq reported no result"
for t in bw lat; do
  p=$((port + 4))
  [ $t = lat ] && p=$((port + 5))
  run_pair ud_send_$t $p 120 -- ib_send_$t -c UD -x 0 -d mrA -p $p -n 1000 -s 1024 \
    -- ib_send_$t -c UD -x 0 -d mrB -p $p -n 1000 -s 1024 127.0.0.1
  grep -qE '^ *1024 +1000' "$LOGDIR/ud_send_$t.client" || fail "UD ib_send_$t reported no result"
done
p=$((port + 6))
run_pair ud_send_bw_srq $p 120 -- ib_send_bw -c UD --use-srq -x 0 -d mrA -p $p -n 500 -s 1024 \
  -- ib_send_bw -c UD --use-srq -x 0 -d mrB -p $p -n 500 -s 1024 127.0.0.1
grep -qE '^ *1024 +500' "$LOGDIR/ud_send_bw_srq.client" || fail "UD ib_send_bw --use-srq reported no result"
echo "PASS srq_ud"
