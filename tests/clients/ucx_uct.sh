#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# UCX's transport layer over MetaRoCE with Debian 12's ucx_perftest (UCX 1.13): every test that
# rc_verbs and ud_verbs support, latency and bandwidth forms, short, bcopy and zcopy, small and
# large messages. A UCT test's server takes the client's parameters, the device included, so
# both ends use mrB and meet through the NIC's loopback. What rc_verbs lacks (a plain 64-bit
# swap: verbs has none) and ud_verbs lacks (put, get, atomics) UCX refuses on any verbs device,
# so they are not run.
source "$(dirname "$0")/ucx_lib.sh"
uct() { local name=$1; shift; perf "$name" "" "" -- -d mrB:1 "$@"; }

for t in "am_lat -D short -s 8" "am_lat -D bcopy -s 1024" "am_bw -D short -s 8" \
         "am_bw -D bcopy -s 4096" "am_bw -D zcopy -s 8192" "put_lat -D short -s 8" \
         "put_bw -D short -s 128" "put_bw -D bcopy -s 4096" "put_bw -D zcopy -s 65536" \
         "put_bw -D zcopy -s 1048576" "get -D bcopy -s 4096" "get -D zcopy -s 65536" \
         "add_lat -s 8" "add_mr -s 8" "fadd -s 8" "cswap -s 8"; do
  n=${t//-[Ds] /}
  uct "rc_verbs.${n// /.}" -x rc_verbs -t $t
done
# A datagram is at most one MTU: ud_verbs' largest bcopy message is 4088 B of the 4096.
for t in "am_lat -D short -s 8" "am_lat -D bcopy -s 1024" "am_bw -D short -s 8" \
         "am_bw -D bcopy -s 4088"; do
  n=${t//-[Ds] /}
  uct "ud_verbs.${n// /.}" -x ud_verbs -t $t
done
echo "ucx_uct: $PASSED tests printed their final line"
