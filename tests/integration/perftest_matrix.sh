#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Unmodified perftest, the feature matrix: ib_{write,read,send,atomic}_{bw,lat}; the bandwidth
# programs with 1 and 8 QPs and bidirectional (-b); inline sends (-I 64 with small sizes); the
# classic post-send path (--use_old_post_send). Small -n keeps the whole matrix near 3 minutes;
# every run must print its result line (and -b runs a result on both sides).
source "$(dirname "$0")/lib.sh"
make_pair
port=18720
runs=0

# pt NAME SIZE PROG [ARGS...]: one server/client pair; the result line must name SIZE.
pt() {
  local name=$1 size=$2 prog=$3
  shift 3
  port=$((port + 1))
  run_pair "$name" $port 60 -- "$prog" -d mrA -x 0 -p $port -s "$size" "$@" \
    -- "$prog" -d mrB -x 0 -p $port -s "$size" "$@" 127.0.0.1
  local line
  line=$(grep -E "^ +$size +[0-9]+ +[0-9.]+" "$LOGDIR/$name.client" | tail -n 1 || true)
  [ -n "$line" ] || fail "$name: no result line for size $size"
  case " $* " in
    *" -b "*) grep -qE "^ +$size +[0-9]+ +[0-9.]+" "$LOGDIR/$name.server" ||
                fail "$name: bidirectional run without a result on the server side" ;;
  esac
  echo "$name: $line"
  runs=$((runs + 1))
}

for verb in write read send atomic; do
  size=65536
  [ $verb = atomic ] && size=8
  pt "${verb}_bw_q1" $size ib_${verb}_bw -n 500 -q 1
  pt "${verb}_bw_q8" $size ib_${verb}_bw -n 200 -q 8
  pt "${verb}_bw_bidir" $size ib_${verb}_bw -n 500 -b
  lat_size=2
  [ $verb = atomic ] && lat_size=8
  pt "${verb}_lat" $lat_size ib_${verb}_lat -n 500
done
# Inline: small payloads carried in the WQE itself.
pt write_bw_inline 64 ib_write_bw -n 1000 -I 64
pt send_bw_inline 32 ib_send_bw -n 1000 -I 64
pt write_lat_inline 8 ib_write_lat -n 500 -I 64
pt send_lat_inline 8 ib_send_lat -n 500 -I 64
# The classic ibv_post_send path instead of the ibv_wr_* builder.
pt write_bw_old 65536 ib_write_bw -n 500 --use_old_post_send
pt read_bw_old 65536 ib_read_bw -n 500 --use_old_post_send
pt send_bw_old_q8 4096 ib_send_bw -n 200 -q 8 --use_old_post_send
pt atomic_bw_old 8 ib_atomic_bw -n 500 --use_old_post_send
pt send_lat_old_inline 8 ib_send_lat -n 500 -I 64 --use_old_post_send
echo "PASS perftest_matrix ($runs runs)"
