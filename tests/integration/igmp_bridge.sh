#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# IGMP on a real snooping switch (wire.md §8): three devices on af_packet ports of a Linux bridge
# in a network namespace the test creates and removes. The bridge snoops IGMP with its querier
# on and floods no unregistered multicast on any port, as a datacenter switch is set up, so a
# group's datagrams reach a port only once its device reported a member. Unmodified mckey:
# (1) a member on mrA joins; the bridge learns the group on mrA's port alone; 100 datagrams from
# mrB all arrive there and none at mrC; the bridge's queries are answered. (2) The member exits:
# its leave (fast leave on the port) removes the entry, and datagrams sent then reach no device.
# Usage: igmp_bridge.sh BUILD_DIR.
if [ -z "${METAROCE_NETNS:-}" ]; then
  [ "$(id -u)" -eq 0 ] || { echo "SKIP: needs root (network namespace, bridge)"; exit 77; }
  command -v ip >/dev/null && command -v bridge >/dev/null || { echo "SKIP: no ip(8)/bridge(8)"; exit 77; }
fi
source "$(dirname "$0")/netns.sh"
run_in_netns mrig "$@"
source "$(dirname "$0")/lib.sh"
GROUP=230.18.0.1   # organisation-local multicast; nothing leaves the namespace
ip link set lo up
# Timers in centiseconds: the querier asks at once and every 60 s; replies within 1 s.
ip link add br0 type bridge mcast_snooping 1 mcast_startup_query_count 2 \
  mcast_startup_query_interval 100 mcast_query_interval 6000 mcast_query_response_interval 100
ip addr add 198.18.0.254/24 dev br0
for d in A B C; do
  ip link add "v$d" type veth peer name "b$d"
  ip link set "b$d" master br0
  bridge link set dev "b$d" mcast_flood off
  ip link set "b$d" up
  ip link set "v$d" up
done
bridge link set dev bA fastleave on
ip link set br0 up
# The querier is switched on once the bridge runs: set at creation, Linux 6.18's bridge kept
# snooping inactive (it flooded, so no port with mcast_flood off got a group's frames).
ip link set br0 type bridge mcast_querier 1
n=0
for d in A B C; do
  n=$((n + 1))
  "$METAROCE" link add "mr$d" --dpdk "net_af_packet$n,iface=v$d" --ip "198.18.0.$n/24" ||
    { echo "SKIP: no af_packet DPDK driver"; exit 77; }
done
eval "$("$METAROCE" env)"

# The bridge ports with an entry for GROUP, sorted, each followed by a space.
mdb_ports() { bridge mdb show dev br0 | sed -n "s/.* port \([^ ]*\) grp $GROUP .*/\1/p" | sort -u | tr '\n' ' '; }
tx_packets() { cat "/sys/class/net/b$1/statistics/tx_packets"; }

# (1) A member joins on mrA: reported, learned on bA only, and the datagrams go there alone.
timeout 60 stdbuf -oL mckey -m "$GROUP" -b 198.18.0.1 -c 1 -C 100 -S 1000 >"$LOGDIR/member" 2>&1 &
member=$!
PIDS+=("$member")
for _ in $(seq 300); do
  grep -q "receiving data transfers" "$LOGDIR/member" && [ "$(mdb_ports)" = "bA " ] && break
  sleep 0.1
done
[ "$(mdb_ports)" = "bA " ] ||
  fail "the bridge learned $GROUP on '$(mdb_ports)', not on bA alone: $(bridge mdb show dev br0)"
[ "$(stat_counter mrA igmp_reports)" -ge 1 ] || fail "mrA counted no IGMP report"
c0=$(tx_packets C)
timeout 60 mckey -m "$GROUP" -b 198.18.0.2 -s -C 100 -S 1000 >"$LOGDIR/sender" 2>&1 ||
  { cat "$LOGDIR/sender"; fail "the sender failed"; }
wait "$member" || { cat "$LOGDIR/member"; bridge mdb show dev br0; fail "the member did not receive its 100 datagrams"; }
sleep 0.3
[ "$(stat_counter mrA mcast_rx_delivered)" -eq 100 ] ||
  fail "mrA delivered $(stat_counter mrA mcast_rx_delivered) datagrams, not 100"
[ "$(stat_counter mrC mcast_rx_no_member)" -eq 0 ] ||
  fail "mrC, no member, was sent $(stat_counter mrC mcast_rx_no_member) datagrams: the bridge flooded"
[ $(( $(tx_packets C) - c0 )) -lt 20 ] || fail "the bridge sent bC $(( $(tx_packets C) - c0 )) frames"
# The querier's startup queries (1 s apart) are answered.
for _ in $(seq 50); do
  [ "$(stat_counter mrA igmp_queries)" -ge 1 ] && break
  sleep 0.1
done
[ "$(stat_counter mrA igmp_queries)" -ge 1 ] || fail "mrA saw no query of the bridge's querier"

# (2) The member is gone: its leave removes the entry (fast leave), and what is sent to the
# group then reaches nobody (no port floods unregistered multicast).
for _ in $(seq 50); do
  [ -z "$(mdb_ports)" ] && break
  sleep 0.1
done
[ -z "$(mdb_ports)" ] || fail "the bridge kept $GROUP on '$(mdb_ports)' after the member left"
[ "$(stat_counter mrA igmp_leaves)" -ge 1 ] || fail "mrA counted no IGMP leave"
a0=$(tx_packets A)
timeout 60 mckey -m "$GROUP" -b 198.18.0.2 -s -C 50 -S 1000 >"$LOGDIR/sender2" 2>&1 ||
  { cat "$LOGDIR/sender2"; fail "the second sender failed"; }
sleep 0.3
[ $(( $(tx_packets A) - a0 )) -lt 20 ] ||
  fail "with no member, the bridge still sent bA $(( $(tx_packets A) - a0 )) frames"
[ "$(stat_counter mrA mcast_rx_no_member)" -eq 0 ] || fail "datagrams reached mrA after it left"
echo "PASS igmp_bridge"
