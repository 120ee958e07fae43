#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The compliance suite (compliance/run.py) against our own engine: in a network namespace it
# creates and removes, a veth pair whose one end is the IUT's port and whose other end is the
# tester's raw socket. The IUT is a link of 4 paths with a receive capacity (so that rate hints
# are in use) over DPDK af_packet on that end, or with --udp over kernel UDP sockets bound to it
# (link.md §5: the host's IP stack in front of the engine, as another implementation might have).
# Usage: run_engine.sh BUILD_DIR [--udp] [run.py options, e.g. --only NAME].
# Exit 77 (skipped) where it cannot run: not root, no namespaces, no af_packet driver, no pyverbs.
HERE=$(cd "$(dirname "$0")" && pwd)
if [ -z "${METAROCE_NETNS:-}" ]; then
  [ "$(id -u)" -eq 0 ] || { echo "SKIP: needs root (network namespace, veth, raw socket)"; exit 77; }
  command -v ip >/dev/null || { echo "SKIP: no ip(8)"; exit 77; }
  /usr/bin/python3 -c 'import pyverbs' 2>/dev/null ||
    { echo "SKIP: no pyverbs (python3-pyverbs)"; exit 77; }
fi
source "$HERE/../tests/integration/netns.sh"
run_in_netns cpcomp "$@"
source "$HERE/../tests/integration/lib.sh"
shift
UDP=0
[ "${1:-}" = --udp ] && { UDP=1; shift; }
ip link set lo up
ip link add cpiut0 type veth peer name cptst0
for i in cpiut0 cptst0; do
  # No kernel chatter (IPv6 router solicitations) on the tester's port.
  sysctl -qw "net.ipv6.conf.$i.disable_ipv6=1" || true
  ip link set "$i" up
done
CAPACITY=20000
EXTRA=()
if [ "$UDP" = 1 ]; then
  command -v ethtool >/dev/null || { echo "SKIP: no ethtool (scripts/install-deps installs it)"; exit 77; }
  # The link's address is the host's, on the IUT's end; the kernel computes the UDP checksums,
  # in full (link.md §5: no offload towards a raw reader).
  ip addr add 198.18.77.1/24 dev cpiut0
  ethtool -K cpiut0 tx off >/dev/null
  PLANE=(--udp cpiut0)
  EXTRA=(--kernel-udp)
else
  PLANE=(--dpdk net_af_packet0,iface=cpiut0)
fi
"$METAROCE" link add cpiut "${PLANE[@]}" --ip 198.18.77.1/24 --paths 4 \
  --rx-capacity "$CAPACITY" >"$LOGDIR/link" 2>&1 ||
  { cat "$LOGDIR/link"; echo "SKIP: cannot make the link (${PLANE[*]})"; exit 77; }
eval "$("$METAROCE" env)"
rc=0
/usr/bin/python3 "$HERE/run.py" --iface cptst0 --iut-ip 198.18.77.1 --dev cpiut \
  --rx-capacity "$CAPACITY" --counters "$METAROCE stat cpiut --json" "${EXTRA[@]}" \
  --log "$LOGDIR/agent" ${COMPLIANCE_XFAIL:+--xfail "$COMPLIANCE_XFAIL"} "$@" || rc=$?
[ "$rc" -eq 0 ] || [ "$rc" -eq 77 ] || fail "compliance checks failed (exit $rc)"
exit "$rc"
