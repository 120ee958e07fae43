#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# UD multicast (docs/spec/verbs-mapping.md §7, wire.md §8) with unmodified programs over two
# devices joined by memif: librdmacm's mckey (RDMA CM joins, ibv_attach_mcast, datagrams to
# QP 0xffffff) with members on the far device and on the sender's own device (the NIC's
# loopback; the sender's QP blocking its own copies), 4000 datagrams posted at once, perftest's
# UD latency test on a multicast group, the `metaroce stat` counters, and
# a member killed with SIGKILL while attached: its attachments go with it, the other members
# still receive; and two-plane devices on the fabric emulator. The group is 230.18.0.0/24's
# first address (organisation-local multicast, never routed): a group has no address in
# 198.18.0.0/15, and nothing leaves the memif link.
source "$(dirname "$0")/lib.sh"
make_pair
GROUP=230.18.0.1

# start_member NAME DEV_IP QPS COUNT: an mckey receiver in the background, ready once joined.
start_member() {
  # Line-buffered: its "receiving data transfers" (all QPs joined and receives posted) is the cue.
  timeout 60 stdbuf -oL mckey -m "$GROUP" -b "$2" -c "$3" -C "$4" -S 1000 >"$LOGDIR/$1" 2>&1 &
  eval "PID_$1=$!"
  PIDS+=("$!")
  for _ in $(seq 300); do
    grep -q "receiving data transfers" "$LOGDIR/$1" && return 0
    sleep 0.1
  done
  cat "$LOGDIR/$1"
  fail "$1 did not join $GROUP"
}

# (1) Members on both devices, the sender on mrB: 4 QPs on mrA (the wire), 2 on mrB (loopback).
# The sender's QP is made with IBV_QP_CREATE_BLOCK_SELF_MCAST_LB (-l): only its own copies stop.
start_member far 198.18.0.1 4 100
start_member near 198.18.0.2 2 100
timeout 60 mckey -m "$GROUP" -b 198.18.0.2 -s -l -C 100 -S 1000 >"$LOGDIR/sender" 2>&1 ||
  { cat "$LOGDIR/sender"; fail "the sender failed"; }
for m in far near; do
  pid_var="PID_$m"
  wait "${!pid_var}" || { cat "$LOGDIR/$m"; fail "member $m did not receive its 100 datagrams per QP"; }
  grep -q "data transfers complete" "$LOGDIR/$m" || fail "member $m: no 'data transfers complete'"
done
sleep 0.3
[ "$(stat_counter mrA mcast_rx_delivered)" -ge 400 ] || fail "mrA counted fewer than 400 deliveries"
[ "$(stat_counter mrB mcast_rx_delivered)" -ge 200 ] || fail "mrB counted fewer than 200 deliveries"
[ "$(stat_counter mrB mcast_tx)" -ge 100 ] || fail "mrB counted fewer than 100 datagrams sent"
for d in mrA mrB; do
  [ "$(stat_counter $d mcast_groups)" -eq 0 ] || fail "$d still has groups after its members exited"
done

# (1b) A bulk: the sender posts 4000 datagrams at once and exits, faster than its port drains.
# They wait in the device for room on the link (a datagram's WQE completes once it left), so the
# member gets every one (before, the port's ring overflowed: 1,056 of 4,000 arrived), and the
# sender's destroying its QP right after posting loses none of what it posted.
rx0=$(stat_counter mrA mcast_rx)
start_member bulk 198.18.0.1 1 4000
timeout 60 mckey -m "$GROUP" -b 198.18.0.2 -s -C 4000 -S 1000 >"$LOGDIR/bulk_sender" 2>&1 ||
  { cat "$LOGDIR/bulk_sender"; fail "the bulk sender failed"; }
wait "$PID_bulk" || { cat "$LOGDIR/bulk"; fail "the member got $(( $(stat_counter mrA mcast_rx) - rx0 )) of 4000 datagrams"; }
[ "$(stat_counter mrB mcast_tx_dropped)" -eq 0 ] || fail "mrB dropped datagrams it sent"

# (2) perftest's UD latency test on a group (-M: its IPv4-mapped GID): both sides attach to that
# one group, so each also takes its own datagrams back (the NIC's loopback, as on a NIC that
# loops multicast back): this shows the program runs, its latencies mean nothing.
MGID=0:0:0:0:0:0:0:0:0:0:255:255:230:18:0:2
run_pair send_lat_mcg 18690 90 -- ib_send_lat -c UD --mcg -M $MGID -x 0 -d mrA -p 18690 -n 1000 -s 512 \
  -- ib_send_lat -c UD --mcg -M $MGID -x 0 -d mrB -p 18690 -n 1000 -s 512 127.0.0.1
grep -qE '^ *512 +1000' "$LOGDIR/send_lat_mcg.client" || fail "ib_send_lat --mcg reported no result"

# (3) A member killed while attached: its QPs' attachments go with it; the others still receive.
start_member doomed 198.18.0.1 2 50
start_member survivor 198.18.0.1 1 50
sleep 0.3
[ "$(stat_counter mrA mcast_groups)" -eq 1 ] || fail "mrA does not show the group of its members"
before=$(stat_counter mrA mcast_rx_delivered)
LD_PRELOAD= pkill -KILL -P "$PID_doomed" mckey || fail "no mckey to kill"  # timeout's child
wait "$PID_doomed" 2>/dev/null || true
timeout 60 mckey -m "$GROUP" -b 198.18.0.2 -s -C 50 -S 1000 >"$LOGDIR/sender2" 2>&1 ||
  { cat "$LOGDIR/sender2"; fail "the second sender failed"; }
wait "$PID_survivor" || { cat "$LOGDIR/survivor"; fail "the surviving member did not receive"; }
sleep 0.3
after=$(stat_counter mrA mcast_rx_delivered)
[ $((after - before)) -eq 50 ] ||
  fail "mrA delivered $((after - before)) datagrams after the kill, not the survivor's 50"
for d in mrA mrB; do
  [ "$(stat_counter $d mcast_groups)" -eq 0 ] || fail "$d kept a group of the killed member"
done
[ "$("$METAROCE" engine status --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["cm_ids"])')" -eq 0 ] ||
  fail "CM ids were left behind"

# (4) Two-plane devices on the fabric emulator (the same addresses, so the memif pair goes
# first): its spine floods a group's frames to every other endpoint, as a switch that does not
# snoop IGMP; the datagram leaves on one plane and reaches the member once.
"$METAROCE" link del mrA >/dev/null
"$METAROCE" link del mrB >/dev/null
fabric_pair mcfab 2 2 11
start_member fabric_member 198.18.0.1 2 100
timeout 60 mckey -m "$GROUP" -b 198.18.0.2 -s -C 100 -S 1000 >"$LOGDIR/sender3" 2>&1 ||
  { cat "$LOGDIR/sender3"; fail "the sender on the fabric failed"; }
wait "$PID_fabric_member" || { cat "$LOGDIR/fabric_member"; fail "the fabric member did not receive"; }
sleep 0.3
[ "$(stat_counter fA mcast_rx_delivered)" -eq 200 ] ||
  fail "fA delivered $(stat_counter fA mcast_rx_delivered) datagrams, not 2 QPs x 100"
fabric_pair_stop mcfab
echo "PASS multicast"
