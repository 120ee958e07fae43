#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Planes on real kernel interfaces: two devices joined by two planes, each a veth pair driven by
# DPDK af_packet (`link add --dpdk` once per plane), in a network namespace the test creates and
# removes. Unmodified ibv_rc_pingpong -c (every buffer checked) and ib_write_bw run over both
# planes (the kernel's counters of each veth show which planes carried them); then, mid-run,
# (1) plane 1 set down by the operator (`link set --plane 1 down`): it carries nothing until it
# is set up; (2) the kernel interface of plane 0 taken down (`ip link set ... down`, a cable
# pull that the af_packet port does not report): the transport finds the dead paths by their
# silence. Both sides exit 0 every time. Usage: planes_af_packet.sh BUILD_DIR.
if [ -z "${METAROCE_NETNS:-}" ]; then
  [ "$(id -u)" -eq 0 ] || { echo "SKIP: needs root (network namespace, veth)"; exit 77; }
  command -v ip >/dev/null || { echo "SKIP: no ip(8)"; exit 77; }
fi
source "$(dirname "$0")/netns.sh"
run_in_netns mrpl "$@"
source "$(dirname "$0")/lib.sh"
ip link set lo up
for p in 0 1; do
  ip link add "va$p" type veth peer name "vb$p"
  # The links' default MTU (9000): veth drops frames above its own.
  ip link set "va$p" mtu 9000 up
  ip link set "vb$p" mtu 9000 up
done
# A kernel interface below the link's MTU is refused with the reason, and nothing is made;
# without --mtu the link takes the interface's.
ip link add vx type veth peer name vy
if "$METAROCE" link add mrX --dpdk net_af_packet9,iface=vx --ip 198.18.0.9/24 --mtu 9000 \
    2>"$LOGDIR/mtu"; then
  fail "a 1500-byte veth under a 9000-byte link was accepted"
fi
grep -q "interface vx has MTU 1500" "$LOGDIR/mtu" || fail "no reason given: $(cat "$LOGDIR/mtu")"
"$METAROCE" link show mrX >/dev/null 2>&1 && fail "the refused link exists"
ip link set vx up
ip link set vy up
"$METAROCE" link add mrX --dpdk net_af_packet9,iface=vx --ip 198.18.0.9/24
"$METAROCE" link show mrX --json | grep -q '"mtu": 1500' || fail "the link did not take vx's MTU"
"$METAROCE" link del mrX
ip link del vx
"$METAROCE" link add mrA --dpdk net_af_packet0,iface=va0 --dpdk net_af_packet1,iface=va1 \
  --ip 198.18.0.1/24 || { echo "SKIP: no af_packet DPDK driver"; exit 77; }
"$METAROCE" link add mrB --dpdk net_af_packet2,iface=vb0 --dpdk net_af_packet3,iface=vb1 \
  --ip 198.18.0.2/24
eval "$("$METAROCE" env)"

# plane_bytes: "bytes-on-plane-0 bytes-on-plane-1", both directions, as the kernel counted them
# on the veth pairs (independent of what the engine says it sent).
plane_bytes() {
  local p out=()
  for p in 0 1; do
    out+=($(( $(cat /sys/class/net/va$p/statistics/tx_bytes) + $(cat /sys/class/net/vb$p/statistics/tx_bytes) )))
  done
  echo "${out[@]}"
}

port=18720
run_pair pingpong $port 60 -- ibv_rc_pingpong -g 0 -d mrA -p $port -c -n 200 \
  -- ibv_rc_pingpong -g 0 -d mrB -p $port -c -n 200 127.0.0.1
read -r b0 b1 < <(plane_bytes)
# 200 x 4 KiB each way at least, sprayed over both planes.
[ "$b0" -gt $((200 << 10)) ] && [ "$b1" -gt $((200 << 10)) ] ||
  fail "both planes should carry the ping-pong: $b0 / $b1 bytes"

# (1) Plane 1 set down mid-run on both devices, then up: nothing fails.
port=$((port + 1))
( sleep 2; "$METAROCE" link set mrA --plane 1 down; "$METAROCE" link set mrB --plane 1 down
  read -r x0 x1 < <(plane_bytes); echo "$x1" >"$LOGDIR/p1_at_down"
  sleep 2; read -r y0 y1 < <(plane_bytes); echo "$y1" >"$LOGDIR/p1_before_up"
  "$METAROCE" link set mrA --plane 1 up; "$METAROCE" link set mrB --plane 1 up ) &
PIDS+=($!)
run_pair admin_down $port 60 -- ib_write_bw -d mrA -x 0 -p $port -s 65536 -D 6 \
  -- ib_write_bw -d mrB -x 0 -p $port -s 65536 -D 6 127.0.0.1
wait
at_down=$(cat "$LOGDIR/p1_at_down") before_up=$(cat "$LOGDIR/p1_before_up")
# A plane set down sends nothing (the frames in flight when it went down were counted before);
# 2 s of ib_write_bw would be hundreds of MB.
[ $((before_up - at_down)) -lt $((64 << 10)) ] ||
  fail "plane 1 carried $((before_up - at_down)) bytes while set down"

# (2) The kernel interface of plane 0 goes down mid-run (af_packet reports no link change: the
# transport finds the dead paths by their silence), then up again.
# failures: the engine's count of paths declared failed or timed out, from stat --json.
failures() {
  "$METAROCE" stat "$1" --json | python3 -c '
import json, sys
c = json.load(sys.stdin)["counters"]
print(c.get("paths_failed", 0) + c.get("timeouts", 0))'
}
port=$((port + 1))
f0=$(( $(failures mrA) + $(failures mrB) ))
( sleep 1; ip link set va0 down; sleep 2; ip link set va0 up ) &
PIDS+=($!)
run_pair cable_pull $port 90 -- ibv_rc_pingpong -g 0 -d mrA -p $port -c -s 4096 -n 100000 \
  -- ibv_rc_pingpong -g 0 -d mrB -p $port -c -s 4096 -n 100000 127.0.0.1
wait
sleep 0.3  # the engine publishes its counters every 100 ms
f1=$(( $(failures mrA) + $(failures mrB) ))
# Else the ping-pong ended before the pull and proved nothing.
[ "$f1" -gt "$f0" ] || fail "the cable pull was not met by the ping-pong (failures $f0 -> $f1)"
echo "PASS planes_af_packet"
