#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# librdmacm without a kernel (docs/spec/cm.md): rdma-core's own unmodified CM programs and
# perftest's -R over two MetaRoCE devices joined by memif, the CM served by the engine. RC with
# data checked (rping -V, several sizes; ucmatose, 8 connections), UD (udaddy), the synchronous
# API with its id migration (rdma_server/rdma_client), perftest's rdma_cm exchange; then
# faults: nobody listening (REJECTED), an address nobody answers (UNREACHABLE), the server and
# then the client killed mid-transfer (the other side hears DISCONNECTED at once, the port can
# be listened on again, the engine keeps nothing of the dead).
source "$(dirname "$0")/lib.sh"
command -v rping >/dev/null || fail "rdmacm-utils is not installed"
make_pair
A=198.18.0.1
B=198.18.0.2

# pair NAME SERVER_CMD -- CLIENT_CMD: both to completion (30 s each at most), both must exit 0.
pair() {
  local name=$1 server=() client=()
  shift
  while [ "$1" != "--" ]; do server+=("$1"); shift; done
  shift
  client=("$@")
  timeout 30 "${server[@]}" >"$LOGDIR/$name.server" 2>&1 &
  local spid=$!
  PIDS+=("$spid")
  sleep 0.5
  local rc=0
  timeout 30 "${client[@]}" >"$LOGDIR/$name.client" 2>&1 || rc=$?
  local src=0
  wait "$spid" || src=$?
  if [ "$rc" -ne 0 ] || [ "$src" -ne 0 ]; then
    tail -n 20 "$LOGDIR/$name.server" "$LOGDIR/$name.client"
    fail "$name: client exit $rc, server exit $src"
  fi
  echo "ok $name"
}

# Connected QPs, every ping's data checked by both sides.
for size in 64 4096 65000; do
  pair "rping-$size" rping -s -a $A -p 7471 -C 20 -V -S $size -- \
    rping -c -I $B -a $A -p 7471 -C 20 -V -S $size
done
pair ucmatose ucmatose -b $A -c 8 -C 50 -- ucmatose -s $A -b $B -c 8 -C 50
pair udaddy udaddy -b $A -c 4 -C 20 -- udaddy -s $A -b $B -c 4 -C 20
pair rdma_server rdma_server -s $A -p 7480 -- rdma_client -s $A -p 7480
pair ib_write_bw-R ib_write_bw -R -d mrA -s 65536 -n 500 -- \
  ib_write_bw -R -d mrA -s 65536 -n 500 $A
pair ib_send_lat-R ib_send_lat -R -d mrA -s 2 -n 500 -- ib_send_lat -R -d mrA -s 2 -n 500 $A

# Nobody listens: the request is rejected (invalid service ID, the kernel's answer), at once.
rc=0
timeout 20 rping -c -I $B -a $A -p 7999 -C 1 >"$LOGDIR/nolisten" 2>&1 || rc=$?
[ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] || fail "rping to a port nobody listens on: exit $rc"
grep -q "RDMA_CM_EVENT_REJECTED, error 8" "$LOGDIR/nolisten" ||
  { cat "$LOGDIR/nolisten"; fail "no REJECTED (invalid service ID) for a port nobody listens on"; }
echo "ok nobody listening: REJECTED"
# An address no engine answers: UNREACHABLE, not a hang.
rc=0
timeout 60 rping -c -I $B -a 198.18.0.77 -p 7471 -C 1 >"$LOGDIR/unreach" 2>&1 || rc=$?
[ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] || fail "rping to an address nobody has: exit $rc"
grep -q "RDMA_CM_EVENT_UNREACHABLE" "$LOGDIR/unreach" ||
  { cat "$LOGDIR/unreach"; fail "no UNREACHABLE for an address nobody has"; }
echo "ok nobody there: UNREACHABLE"

# kill_mid VICTIM PORT: an endless rping pair, the victim (server or client) killed after 2 s;
# the survivor must hear DISCONNECTED and exit within 10 s.
kill_mid() {
  local victim=$1 port=$2
  rping -s -a $A -p "$port" -C 0 -V >"$LOGDIR/kill-$victim.server" 2>&1 &
  local spid=$!
  PIDS+=("$spid")
  sleep 0.5
  rping -c -I $B -a $A -p "$port" -C 0 -V >"$LOGDIR/kill-$victim.client" 2>&1 &
  local cpid=$!
  PIDS+=("$cpid")
  sleep 2
  kill -0 "$spid" && kill -0 "$cpid" || fail "kill-$victim: the pair did not run"
  local dead=$spid survivor=$cpid
  [ "$victim" = client ] && { dead=$cpid; survivor=$spid; }
  kill -KILL "$dead"
  for _ in $(seq 100); do kill -0 "$survivor" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$survivor" 2>/dev/null; then
    tail -n 5 "$LOGDIR/kill-$victim".*
    fail "kill-$victim: the other side still runs 10 s after the kill"
  fi
  wait "$survivor" 2>/dev/null || true
  grep -q "DISCONNECT EVENT" "$LOGDIR/kill-$victim".* ||
    { tail -n 5 "$LOGDIR/kill-$victim".*; fail "kill-$victim: no DISCONNECTED"; }
  echo "ok $victim killed: the other side disconnected"
}
kill_mid server 7490
# The dead server's listener went with it: its port can be listened on again.
pair relisten rping -s -a $A -p 7490 -C 5 -V -- rping -c -I $B -a $A -p 7490 -C 5 -V
kill_mid client 7491

# Nothing of them is left: the engine serves no CM channel and no context.
sleep 0.5
status=$("$METAROCE" engine status --json)
echo "$status" | grep -q '"cm_ids": 0' || { echo "$status"; fail "the engine still holds CM ids"; }
echo "PASS rdmacm"
