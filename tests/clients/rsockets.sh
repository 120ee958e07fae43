#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# rsockets (librdmacm's sockets over RDMA) through the engine's RDMA CM, with rdmacm-utils'
# rstream and riostream: latency-sized and bandwidth-sized transfers, blocking and non-blocking
# calls, every byte verified (-T v). The server binds mrA's address, the client connects from
# mrB's. Not rstream's asynchronous mode (-T a): there the client exits 16 (POLLHUP from its
# rpoll, which it takes for an error) in 3 runs of 4 after the server has seen every transfer
# and shut down. As librdmacm reads (rsockets.c), the server's in-band DISCONNECT follows its
# data on the QP, a client that reads both in one CQ poll is marked disconnected with data
# still unread, and rpoll reports POLLHUP beside POLLIN; a faster client would not see it.
source "$(dirname "$0")/../integration/lib.sh"
command -v rstream >/dev/null || { echo "SKIP: rstream (rdmacm-utils) is not installed"; exit 77; }
make_pair
port=7480
for t in "rstream -S 64 -C 2000 -T v" "rstream -S 1048576 -C 50 -T v -T b" \
         "rstream -S 4096 -C 1000 -T v -T n" \
         "riostream -S 65536 -C 200 -T v" "riostream -S 1048576 -C 20 -T v -T b"; do
  port=$((port + 1))
  set -- $t
  name="$1-$3-${9:-}"
  timeout 60 "$@" -p $port -b 198.18.0.1 >"$LOGDIR/$name.server" 2>&1 &
  spid=$!
  PIDS+=("$spid")
  wait_cm_listener
  crc=0 src=0
  timeout 60 "$@" -p $port -s 198.18.0.1 -b 198.18.0.2 >"$LOGDIR/$name.client" 2>&1 || crc=$?
  wait "$spid" || src=$?
  [ "$crc" -eq 0 ] && [ "$src" -eq 0 ] ||
    { tail -n 10 "$LOGDIR/$name.server" "$LOGDIR/$name.client"
      fail "$t: server exit $src, client exit $crc"; }
  grep -qi "error\|fail\|mismatch" "$LOGDIR/$name.client" && fail "$t reported an error"
  echo "$t: $(tail -n 1 "$LOGDIR/$name.client")"
done
