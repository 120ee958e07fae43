#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Unmodified perftest between two processes over MetaRoCE: bandwidth and latency programs, with
# the new post-send API (default) and --use_old_post_send, sizes from 2 B to 1 MiB.
source "$(dirname "$0")/lib.sh"
make_pair
port=18630
sizes=${PERFTEST_SIZES:-"2 4096 65536 1048576"}
for prog in ib_write_bw ib_send_bw ib_read_bw ib_write_lat ib_send_lat; do
  for mode in "" "--use_old_post_send"; do
    for size in $sizes; do
      iters=200
      [ "$size" -ge 65536 ] && iters=50
      port=$((port + 1))
      name="$prog-$size${mode:+-old}"
      run_pair "$name" $port 60 -- $prog -d mrA -x 0 -p $port -s "$size" -n $iters $mode \
        -- $prog -d mrB -x 0 -p $port -s "$size" -n $iters $mode 127.0.0.1
      line=$(grep -E "^ +$size " "$LOGDIR/$name.client" | tail -n 1 || true)
      [ -n "$line" ] || fail "$name: no result line for size $size"
      echo "$name: $line"
    done
  done
done
echo "PASS perftest"
