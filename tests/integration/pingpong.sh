#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Unmodified ibv_rc_pingpong between two processes, each on its own MetaRoCE device, over memif.
source "$(dirname "$0")/lib.sh"
make_pair
port=18610
run_pair rc_pingpong $port 60 -- ibv_rc_pingpong -g 0 -d mrA -p $port -n 200 \
  -- ibv_rc_pingpong -g 0 -d mrB -p $port -n 200 127.0.0.1
grep -q '1638400 bytes in' "$LOGDIR/rc_pingpong.client" || fail "client did not report its 200 x 4096-byte round trips"
run_pair rc_pingpong_big $((port + 1)) 60 -- ibv_rc_pingpong -g 0 -d mrA -p $((port + 1)) -s 65536 -n 50 \
  -- ibv_rc_pingpong -g 0 -d mrB -p $((port + 1)) -s 65536 -n 50 127.0.0.1
echo "PASS pingpong"
