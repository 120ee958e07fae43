#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# The kernel suite, inside the guest (tests/kernel/kernel.sh boots it): metaroce_ib loaded, two
# devices made with `rdma link add` over a veth pair and served by the engine, unmodified
# programs on them, removal, unload, and nothing left behind.
. /lib.sh
setup_veth
export METAROCE_RUNDIR=/run/metaroce

check load insmod "/lib/modules/$K/extra/metaroce_ib.ko"
check engine_start metaroce engine start
check rdma_link_add sh -c 'rdma link add mr0 type metaroce netdev veth0 &&
                           rdma link add mr1 type metaroce netdev veth1'
wait_ports() { wait_port mr0 ACTIVE && wait_port mr1 ACTIVE; }
check ports_active wait_ports
rdma link show
metaroce link show
check ibv_devices sh -c 'ibv_devices && ibv_devices | grep -q mr0 && ibv_devices | grep -q mr1'
check ibv_devinfo sh -c 'ibv_devinfo -d mr0 && ibv_devinfo -d mr0 | grep -q PORT_ACTIVE &&
                         ibv_devinfo -d mr0 | grep -q "link_layer:.*Ethernet"'
X0=$(gid_index mr0 198.18.0.1); X1=$(gid_index mr1 198.18.0.2)
echo "GID index mr0=$X0 mr1=$X1"

# pair NAME SERVER... -- CLIENT...: the server on mr0 in the background, the client on mr1.
pair() {
  local tag=$1 srv="" sp rc src; shift
  while [ "$1" != -- ]; do srv="$srv $1"; shift; done; shift
  timeout 300 $srv > "/tmp/$tag.srv" 2>&1 &
  sp=$!
  sleep 2
  timeout 300 "$@" > "/tmp/$tag.cli" 2>&1; rc=$?
  wait $sp; src=$?
  cat "/tmp/$tag.srv" "/tmp/$tag.cli" | tail -25
  [ "$rc" -eq 0 ] && [ "$src" -eq 0 ]
}
check rc_pingpong_events pair pp ibv_rc_pingpong -d mr0 -g "$X0" -e -s 4096 -n 500 -- \
  ibv_rc_pingpong -d mr1 -g "$X1" -e -s 4096 -n 500 198.18.0.1
# UC: the kernel's QP of that type, the engine's unreliable-connected service.
check uc_pingpong pair uc ibv_uc_pingpong -d mr0 -g "$X0" -s 4096 -n 200 -- \
  ibv_uc_pingpong -d mr1 -g "$X1" -s 4096 -n 200 198.18.0.1
check ib_write_bw pair bw ib_write_bw -d mr0 -x "$X0" -s 65536 -D 3 -F -p 18600 -- \
  ib_write_bw -d mr1 -x "$X1" -s 65536 -D 3 -F -p 18600 198.18.0.1
grep -E '^ *65536 ' /tmp/bw.cli

# rdma-core's pyverbs tests of the device, completion events and queue pairs (one device).
cd /opt/rdma-tests
check pyverbs timeout 900 python3 tests/run_tests.py --dev mr0 --gid "$X0" -v \
  test_device test_cq_events test_qp
grep -E '^(Ran|OK|FAILED)' /tmp/pyverbs.log
grep -oE "skipped '[^']*'" /tmp/pyverbs.log | sort | uniq -c
cd /

# Every object of the programs above is gone from the kernel and the engine.
check no_objects sh -c 'for d in mr0 mr1; do cat /sys/class/infiniband/$d/metaroce/objects;
  grep -q "contexts 0 pds 0 mrs 0 cqs 0 srqs 0 qps 0" /sys/class/infiniband/$d/metaroce/objects ||
  exit 1; done; [ -z "$(rdma res show qp | grep -E "mr[01]")" ]'

# Removal both ways: the engine's link goes with the kernel device.
check metaroce_link_del sh -c 'metaroce link del mr1 && ! [ -e /sys/class/infiniband/mr1 ]'
check rdma_link_delete sh -c 'rdma link delete mr0 && sleep 1 && ! metaroce link show mr0'
# And a link added by `metaroce link add` is a kernel device where the module is loaded.
check metaroce_link_add sh -c 'metaroce link add mr2 --udp veth0 --ip 198.18.0.1/24 &&
  ibv_devinfo -d mr2 | grep -q PORT_ACTIVE && metaroce link del mr2'

check engine_stop metaroce engine stop
check rmmod rmmod metaroce_ib
check dmesg_clean dmesg_clean
echo "--- engine log"; tail -30 /run/metaroce/engine.log 2>/dev/null
echo "--- dmesg"; dmesg | tail -25
echo "=== $failures failures"
