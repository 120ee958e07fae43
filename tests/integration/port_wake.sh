#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# A napping engine is woken by the frame, not by the end of its nap: two engines (two run dirs,
# as two hosts), one device each on the two ends of a veth pair, one driven by DPDK af_packet
# and the other by af_xdp (af_packet where af_xdp is missing), both engines adaptive with no
# spin window, so that they nap whenever they are idle. An unmodified ibv_rc_pingpong -c runs
# between them; then each engine must say that its link wakes it (`engine status`:
# links_port_wake) and that frames ended some of its naps (naps_frame), which only a port's
# receive descriptor in the nap's poll can do: without it the count stays 0. A veth end then
# taken down and brought back (the AF_PACKET socket reports ENETDOWN, an error that polls as
# ready until read) must not leave the engine waking at once from every nap: idle, it naps
# fewer than 20,000 times in a second (730,000 while the error polled ready; a loaded host can
# only lower the count), and a second ping-pong passes. Usage: port_wake.sh BUILD_DIR.
if [ -z "${METAROCE_NETNS:-}" ]; then
  [ "$(id -u)" -eq 0 ] || { echo "SKIP: needs root (network namespace, veth)"; exit 77; }
  command -v ip >/dev/null || { echo "SKIP: no ip(8)"; exit 77; }
fi
source "$(dirname "$0")/netns.sh"
run_in_netns mrpw "$@"
source "$(dirname "$0")/lib.sh"
ip link set lo up
ip link add pwa type veth peer name pwb
ip link set pwa up
ip link set pwb up

# The second "host": its own run dir and engine, stopped and removed with the first's.
RUN_B=$(mktemp -d "/tmp/metaroce-$TEST_NAME-b.XXXXXX")
on_b() { METAROCE_RUNDIR=$RUN_B "$@"; }
trap 'rc=$?; set +e; on_b "$METAROCE" link del mrB >/dev/null 2>&1; on_b "$METAROCE" engine stop >/dev/null 2>&1;
  LD_PRELOAD= timeout 10 pkill -f -- "--rundir $RUN_B( |\$)" 2>/dev/null;
  [ $rc -ne 0 ] && [ -f "$RUN_B/engine.log" ] && { echo "== engine B log"; tail -n 40 "$RUN_B/engine.log"; };
  rm -rf "$RUN_B"; (exit $rc); cleanup' EXIT

"$METAROCE" engine start --spin-us 0
on_b "$METAROCE" engine start --spin-us 0
"$METAROCE" link add mrA --dpdk net_af_packet0,iface=pwa --ip 198.18.0.1/24 ||
  { echo "SKIP: no af_packet DPDK driver"; exit 77; }
kind_b=af_xdp
if ! on_b "$METAROCE" link add mrB --dpdk net_af_xdp0,iface=pwb --ip 198.18.0.2/24 \
    2>"$LOGDIR/af_xdp"; then
  echo "no af_xdp here ($(head -c 200 "$LOGDIR/af_xdp")): af_packet on both ends"
  kind_b=af_packet
  on_b "$METAROCE" link add mrB --dpdk net_af_packet1,iface=pwb --ip 198.18.0.2/24
fi

# status RUNDIR FIELD: a figure of that engine's `engine status --json`.
status() {
  METAROCE_RUNDIR=$1 "$METAROCE" engine status --json | python3 -c '
import json, sys
print(json.load(sys.stdin)[sys.argv[1]])' "$2"
}
# pingpong NAME PORT: ibv_rc_pingpong -c, server on mrA (engine A), client on mrB (engine B).
eval "$("$METAROCE" env)"
pingpong() {
  run_pair "$1" "$2" 60 -- ibv_rc_pingpong -g 0 -d mrA -p "$2" -c -n 200 \
    -- env METAROCE_RUNDIR="$RUN_B" SYSFS_PATH="$RUN_B/sys" ibv_rc_pingpong -g 0 -d mrB -p "$2" \
    -c -n 200 127.0.0.1
}

for run in A B; do
  dir=$METAROCE_RUNDIR
  [ $run = B ] && dir=$RUN_B
  [ "$(status "$dir" links_port_wake)" = 1 ] ||
    fail "engine $run: its link does not wake it: $(METAROCE_RUNDIR=$dir "$METAROCE" engine status)"
done
pingpong first 18740
for run in A B; do
  dir=$METAROCE_RUNDIR
  [ $run = B ] && dir=$RUN_B
  naps=$(status "$dir" naps) frame=$(status "$dir" naps_frame)
  echo "engine $run ($([ $run = A ] && echo af_packet || echo $kind_b)): $naps naps, $frame ended by a frame"
  [ "$frame" -gt 0 ] || fail "engine $run: no nap was ended by a frame ($naps naps)"
done

# A cable pulled and put back: the socket's ENETDOWN is read once, not polled forever.
ip link set pwa down
sleep 0.5
ip link set pwa up
sleep 0.5
before=$(status "$METAROCE_RUNDIR" naps)
sleep 1
after=$(status "$METAROCE_RUNDIR" naps)
# Idle, the engine naps up to its shortest timer (1 ms by default) or longer: a socket polling
# ready at once would make it hundreds of thousands of naps a second.
[ $((after - before)) -lt 20000 ] ||
  fail "engine A naps $((after - before)) times in a second when idle: something polls ready"
pingpong after_flap 18741
echo "OK: both engines woken by their ports ($kind_b on B); a flapped interface leaves naps quiet"
