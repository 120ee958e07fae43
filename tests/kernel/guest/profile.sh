#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Where the CPU goes in the guest of bench/kernel_guest.sh (KG_PROFILE=1 boots it): the same
# devices as bench.sh (two MetaRoCE, two rxe, one veth pair), then per kind an unmodified
# ib_write_bw 64 KiB run with a window of `perf record -a` in its middle, and for MetaRoCE the
# system calls of the engine's datapath thread and its packet counters over a second window.
# Prints PROFILE lines: shares per command and object, top symbols, the engine thread's user and
# system ticks, system calls and packets in the window.
. /lib.sh
arg() { v=$(tr ' ' '\n' < /proc/cmdline | sed -n "s/^$1=//p" | tail -1); echo "${v:-$2}"; }
MTU=$(arg kg.mtu 9000)
WIN=$(arg kg.window 3)
export METAROCE_RUNDIR=/run/metaroce
setup_veth
insmod "/lib/modules/$K/extra/metaroce_ib.ko"
mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null
echo 0 > /proc/sys/kernel/kptr_restrict
echo -1 > /proc/sys/kernel/perf_event_paranoid
metaroce engine start > /dev/null
rxe_beside
echo "PROFILE config mtu=$MTU window=${WIN}s cpus=$(nproc)"

# dp_tid: the engine's datapath thread; ticks TID: its user and system time (clock ticks).
dp_tid() {
  for t in /proc/$(pidof metaroced)/task/*; do
    [ "$(cat "$t/comm")" = metaroce-dp ] && echo "${t##*/}"
  done
}
ticks() { cut -d' ' -f14,15 "/proc/$(pidof metaroced)/task/$1/stat"; }
counters() {
  metaroce stat "$1" 2>/dev/null | tr -s ' ' |
    grep -oE '(tx_packets|rx_packets|acks_sent|acks_received|retransmits|timeouts) [0-9]+' |
    tr '\n' ' '
}

port=18800
profile() {
  local kind=$1 dev=$2 x0 x1 sp cp tid line
  x0=$(gid_index ${dev}0 198.18.0.1); x1=$(gid_index ${dev}1 198.18.0.2)
  port=$((port + 1))
  ib_write_bw -s 65536 -D $((3 * WIN + 4)) -d ${dev}0 -x "$x0" -p $port -F > /tmp/srv.log 2>&1 &
  sp=$!
  sleep 1
  ib_write_bw -s 65536 -D $((3 * WIN + 4)) -d ${dev}1 -x "$x1" -p $port -F 198.18.0.1 \
    > /tmp/cli.log 2>&1 &
  cp=$!
  sleep 2
  perf record -a -o /tmp/perf.data -- sleep "$WIN" > /dev/null 2>&1
  if [ "$kind" = mr ]; then
    tid=$(dp_tid)
    echo "PROFILE mr before ticks $(ticks "$tid") mr1 $(counters mr1) mr0 $(counters mr0)"
    perf stat -x, -t "$tid" -e raw_syscalls:sys_enter,syscalls:sys_enter_sendmmsg \
      -e syscalls:sys_enter_recvmmsg,syscalls:sys_enter_ppoll,syscalls:sys_enter_ioctl \
      -- sleep "$WIN" 2>&1 | awk -F, '/syscalls/ {print "PROFILE mr syscalls", $3, $1}'
    echo "PROFILE mr after ticks $(ticks "$tid") mr1 $(counters mr1) mr0 $(counters mr0)"
  fi
  wait $cp; wait $sp
  line=$(grep -E '^ *[0-9]+ +[0-9]+ ' /tmp/cli.log | tail -1 | tr -s ' \t' ' ')
  echo "PROFILE $kind result $line"
  perf report -i /tmp/perf.data --no-children --sort comm,dso 2>/dev/null | grep '%' | head -12 |
    tr -s ' ' | sed "s/^/PROFILE $kind share/"
  perf report -i /tmp/perf.data --no-children --sort comm,sym 2>/dev/null | grep '%' | head -25 |
    tr -s ' ' | sed "s/^/PROFILE $kind symbol/"
}
profile mr mr
profile rxe rxe
metaroce engine stop
