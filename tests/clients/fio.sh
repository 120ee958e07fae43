#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# fio's rdma engine (Debian's fio) over MetaRoCE through the engine's RDMA CM: 64 MiB in 64 KiB
# blocks with each of its verbs (RDMA WRITE, RDMA READ, SEND), 16 in flight. fio's receiving job
# listens on mrA's address and must be up before the sending job connects (a connection that
# finds no listener is rejected, and fio does not retry). fio checks no data.
source "$(dirname "$0")/../integration/lib.sh"
command -v fio >/dev/null || { echo "SKIP: fio is not installed"; exit 77; }
make_pair
port=14300
for verb in write read send; do
  port=$((port + 1))
  cat >"$LOGDIR/$verb-receiver.fio" <<FIO
[receiver]
ioengine=rdma
hostname=198.18.0.1
port=$port
verb=$verb
bs=64k
size=64m
rw=read
iodepth=16
FIO
  cat >"$LOGDIR/$verb-sender.fio" <<FIO
[sender]
ioengine=rdma
hostname=198.18.0.1
port=$port
bs=64k
size=64m
rw=write
iodepth=1
FIO
  timeout 60 fio "$LOGDIR/$verb-receiver.fio" >"$LOGDIR/$verb.receiver" 2>&1 &
  rpid=$!
  PIDS+=("$rpid")
  wait_cm_listener
  src=0 rrc=0
  timeout 60 fio "$LOGDIR/$verb-sender.fio" >"$LOGDIR/$verb.sender" 2>&1 || src=$?
  wait "$rpid" || rrc=$?
  [ "$src" -eq 0 ] && [ "$rrc" -eq 0 ] &&
    grep -q "err= 0" "$LOGDIR/$verb.sender" && grep -q "err= 0" "$LOGDIR/$verb.receiver" ||
    { tail -n 12 "$LOGDIR/$verb.receiver" "$LOGDIR/$verb.sender"
      fail "fio rdma verb=$verb: sender exit $src, receiver exit $rrc"; }
  echo "fio rdma verb=$verb: $(grep -o 'WRITE: bw=[^,]*' "$LOGDIR/$verb.sender")"
done
