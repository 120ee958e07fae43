#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# The kernel suite, inside the guest (tests/kernel/kernel.sh boots it).
. /lib.sh
setup_veth

check load insmod "/lib/modules/$K/extra/metaroce_ib.ko"
check rdma_link_add sh -c 'rdma link add mr0 type metaroce netdev veth0 &&
                           rdma link add mr1 type metaroce netdev veth1'
rdma link show
check ibv_devices sh -c 'ibv_devices; ibv_devices | grep -q mr0 && ibv_devices | grep -q mr1'
check devinfo_without_engine sh -c 'ibv_devinfo -d mr0; ibv_devinfo -d mr0 | grep -q PORT_DOWN'
ls -la /sys/class/infiniband/mr0/ /sys/class/infiniband/mr0/metaroce
cat /sys/class/infiniband/mr0/ports/1/gids/0 /sys/class/infiniband/mr0/ports/1/gids/1
check gid_v2 gid_index mr0 198.18.0.1
check rdma_link_delete sh -c 'rdma link delete mr0 && rdma link delete mr1'
check rmmod rmmod metaroce_ib
check dmesg_clean dmesg_clean
dmesg | tail -20
