#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# UCX's protocol layer over MetaRoCE, as Open MPI and users of UCP reach it (Debian 12's UCX
# 1.13): ucx_perftest's tag, stream, RMA, atomic and active-message tests between a server on
# mrA and a client on mrB with UCX_TLS naming only our transports (UD wires up the RC
# endpoints); then UCX's own client-server program, io_demo, connecting through the RDMA CM
# (the engine serves it) with every byte checked.
source "$(dirname "$0")/ucx_lib.sh"
export UCX_TLS=rc_verbs,ud_verbs,self
ucp() { local name=$1; shift; perf "$name" UCX_NET_DEVICES=mrA:1 UCX_NET_DEVICES=mrB:1 -- "$@"; }

for t in "tag_lat -s 8" "tag_bw -s 8" "tag_bw -s 65536" "tag_bw -s 4194304" \
         "tag_sync_lat -s 8" "stream_bw -s 65536" "stream_lat -s 8" "ucp_put_lat -s 8" \
         "ucp_put_bw -s 65536" "ucp_get -s 65536" "ucp_add -s 8" "ucp_fadd -s 8" \
         "ucp_swap -s 8" "ucp_cswap -s 8" "ucp_am_lat -s 8" "ucp_am_bw -s 65536"; do
  n=${t//-s /}
  ucp "ucp.${n// /.}" -t $t
done

echo "== UCP client-server over the RDMA CM (io_demo, tag and active-message APIs)"
# io_demo (ucx-utils) is UCX's own client-server program: the client connects to a listener's
# IP address through a connection manager, then runs read and write requests of 1 B to 1 MiB
# with every byte checked (-q). The CM, not TCP, sets the connection up (SOCKADDR_TLS_PRIORITY);
# the client binds mrB's address (-I), the server listens on mrA's.
export UCX_SOCKADDR_TLS_PRIORITY=rdmacm
port=13390
for api in tag am; do
  port=$((port + 1))
  flags=(-q -d 1:1048576 -p $port)
  [ $api = am ] && flags+=(-A)
  UCX_NET_DEVICES=mrA:1 timeout 120 io_demo "${flags[@]}" >"$LOGDIR/io-$api.server" 2>&1 &
  spid=$!
  PIDS+=("$spid")
  wait_cm_listener  # it listens through the RDMA CM alone
  crc=0
  UCX_NET_DEVICES=mrB:1 UCX_LOG_LEVEL=debug UCX_LOG_FILE="$LOGDIR/io-$api.ucx" \
    timeout 120 io_demo "${flags[@]}" -i 2000 -o read,write -I 198.18.0.2 198.18.0.1 \
    >"$LOGDIR/io-$api.client" 2>&1 || crc=$?
  kill "$spid" 2>/dev/null || true  # it serves one client after another for ever
  wait "$spid" 2>/dev/null || true
  [ "$crc" -eq 0 ] && grep -q "Client exit with status 'OK'" "$LOGDIR/io-$api.client" ||
    { tail -n 20 "$LOGDIR/io-$api.client" "$LOGDIR/io-$api.server"
      fail "io_demo ${flags[*]}: client exit $crc"; }
  grep -q "created an endpoint on rdmacm" "$LOGDIR/io-$api.ucx" ||
    fail "io_demo ($api): UCX did not connect through the RDMA CM"
  grep -qi "assert\|corrupt\|mismatch" "$LOGDIR/io-$api.server" "$LOGDIR/io-$api.client" &&
    fail "io_demo ($api) reported damaged data"
  echo "io_demo ($api): 2000 checked reads and writes of 1 B to 1 MiB over a CM-made endpoint"
  PASSED=$((PASSED + 1))
done
echo "ucx_ucp: $PASSED tests passed"
