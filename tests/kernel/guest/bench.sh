#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# MetaRoCE against Soft-RoCE (rdma_rxe) in one guest, one run (bench/kernel_guest.sh boots it):
# both kinds of device over the same veth pair, unmodified ib_write_bw 64 KiB and ib_write_lat
# 2 B, alternated REPS times so that both see the same host load. MetaRoCE runs once per engine
# idle policy of SPINS (the engine restarts between them; the devices stay and it re-attaches
# them). Prints BENCH lines: BENCH KIND TEST <perftest's result line>.
. /lib.sh
arg() { v=$(tr ' ' '\n' < /proc/cmdline | sed -n "s/^$1=//p" | tail -1); echo "${v:-$2}"; }
MTU=$(arg kg.mtu 9000)
DUR=$(arg kg.dur 5)
LATN=$(arg kg.latn 5000)
REPS=$(arg kg.reps 3)
SPINS=$(arg kg.spins adaptive,always | tr ',' ' ')
export METAROCE_RUNDIR=/run/metaroce
setup_veth
insmod "/lib/modules/$K/extra/metaroce_ib.ko"
# engine POLICY[@NICE]: a fresh engine, e.g. adaptive@0 for adaptive with its threads at nice 0.
engine() {
  local nice=""
  case "$1" in *@*) nice="--nice ${1#*@}" ;; esac
  metaroce engine stop > /dev/null 2>&1
  metaroce engine start --spin "${1%@*}" $nice > /dev/null || { echo "BENCH engine $1 FAILED"; return 1; }
  wait_port mr0 ACTIVE && wait_port mr1 ACTIVE
}
first=${SPINS%% *}
metaroce engine start --spin "${first%@*}"
rxe_beside
echo "BENCH config mtu=$MTU dur=$DUR latn=$LATN reps=$REPS spins=$(echo $SPINS | tr ' ' ',') cpus=$(nproc)"
for d in mr0 rxe0; do
  echo "BENCH $d $(ibv_devinfo -d $d | grep -E 'active_mtu' | tr -s ' \t' ' ')"
done

port=18700
# run KIND DEV TEST TOOL ARGS...: server on DEV0, client on DEV1; prints the result line.
run() {
  local kind=$1 dev=$2 test=$3 x0 x1 sp; shift 3
  x0=$(gid_index ${dev}0 198.18.0.1); x1=$(gid_index ${dev}1 198.18.0.2)
  port=$((port + 1))
  timeout 120 "$@" -d ${dev}0 -x "$x0" -p $port -F > /tmp/srv.log 2>&1 &
  sp=$!
  sleep 1
  if timeout 120 "$@" -d ${dev}1 -x "$x1" -p $port -F 198.18.0.1 > /tmp/cli.log 2>&1; then
    line=$(grep -E '^ *[0-9]+ +[0-9]+ ' /tmp/cli.log | tail -1 | tr -s ' \t' ' ')
    # perftest gives inf when its CPU clock calibration failed (r^2 < 0.9 under a loaded host).
    case "$line" in *inf*) echo "BENCH $kind $test UNCALIBRATED" ;; *) echo "BENCH $kind $test $line" ;; esac
  else
    echo "BENCH $kind $test FAILED"; tail -5 /tmp/cli.log /tmp/srv.log
  fi
  wait $sp
}
i=0
while [ "$i" -lt "$REPS" ]; do
  run rxe rxe wbw64k ib_write_bw -s 65536 -D "$DUR"
  run rxe rxe wlat2 ib_write_lat -s 2 -n "$LATN"
  for s in $SPINS; do
    engine "$s" || continue
    run "mr-$s" mr wbw64k ib_write_bw -s 65536 -D "$DUR"
    run "mr-$s" mr wlat2 ib_write_lat -s 2 -n "$LATN"
    # What loss recovery did; BENCH udp below says whether the guest really dropped packets.
    echo "BENCH mr-$s counters $(metaroce stat mr1 2>/dev/null | tr -s ' ' |
      grep -oE '(retransmits|timeouts|paths_failed) [0-9]+' | tr '\n' ' ')"
  done
  i=$((i + 1))
done
metaroce engine stop
# Datagrams the guest's UDP sockets dropped (RcvbufErrors: a full receive buffer).
echo "BENCH udp $(grep '^Udp:' /proc/net/snmp | tr '\n' ' ')"
