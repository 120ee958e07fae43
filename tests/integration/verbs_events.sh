#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Unmodified ibv_rc_pingpong with completion channels (-e: ibv_create_comp_channel,
# ibv_req_notify_cq, ibv_get_cq_event with no kernel) and with the ibv_qp_ex send API (-N),
# between two processes over memif; ib_send_bw -e and ib_atomic_{bw,lat} as perftest users of the same.
# Channels come from libmetaroce-preload.so, which `metaroce env` puts in LD_PRELOAD; without it
# ibv_create_comp_channel fails cleanly (libibverbs' own, unmodified, gets ENOSPC).
source "$(dirname "$0")/lib.sh"
make_pair
case "${LD_PRELOAD:-}" in
  *libmetaroce-preload.so*) ;;
  *) fail "metaroce env did not put libmetaroce-preload.so in LD_PRELOAD" ;;
esac
set +e
LD_PRELOAD=$SAN_PRELOAD timeout 20 ibv_rc_pingpong -g 0 -d mrA -p 18639 -n 10 -e >"$LOGDIR/no_preload" 2>&1
rc=$?
set -e
[ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] || fail "without the preload: exit $rc, expected a clean failure"
grep -q "Couldn't create completion channel" "$LOGDIR/no_preload" ||
  fail "without the preload: $(cat "$LOGDIR/no_preload")"
port=18640
run_pair rc_pingpong_events $port 60 -- ibv_rc_pingpong -g 0 -d mrA -p $port -n 200 -e \
  -- ibv_rc_pingpong -g 0 -d mrB -p $port -n 200 -e 127.0.0.1
grep -q '1638400 bytes in' "$LOGDIR/rc_pingpong_events.client" || fail "-e: no 200 round trips"
run_pair rc_pingpong_new_api $((port + 1)) 60 -- ibv_rc_pingpong -g 0 -d mrA -p $((port + 1)) -n 200 -N \
  -- ibv_rc_pingpong -g 0 -d mrB -p $((port + 1)) -n 200 -N 127.0.0.1
grep -q '1638400 bytes in' "$LOGDIR/rc_pingpong_new_api.client" || fail "-N: no 200 round trips"
run_pair send_bw_events $((port + 2)) 120 -- ib_send_bw -x 0 -d mrA -p $((port + 2)) -n 2000 -e \
  -- ib_send_bw -x 0 -d mrB -p $((port + 2)) -n 2000 -e 127.0.0.1
grep -qE '^ *65536 +2000' "$LOGDIR/send_bw_events.client" || fail "ib_send_bw -e reported no result"
for t in bw lat; do
  p=$((port + 3))
  [ $t = lat ] && p=$((port + 4))
  run_pair atomic_$t $p 120 -- ib_atomic_$t -x 0 -d mrA -p $p -n 1000 \
    -- ib_atomic_$t -x 0 -d mrB -p $p -n 1000 127.0.0.1
  grep -qE '^ *8 +1000' "$LOGDIR/atomic_$t.client" || fail "ib_atomic_$t reported no result"
done
echo "PASS verbs_events"
