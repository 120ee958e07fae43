# SPDX-License-Identifier: Apache-2.0
# For tests that make veth pairs, bridges or raw sockets: a network namespace of their own.
# Sourced before lib.sh, after the test's own checks of what it needs (root, ip(8), ...).

# run_in_netns PREFIX ARGS...: unless already inside one, re-runs this test ($0 ARGS...) in a
# new network namespace named PREFIX and the pid, removes it afterwards, and exits with the
# test's status (77, skipped, when no namespace can be made).
run_in_netns() {
  [ -n "${METAROCE_NETNS:-}" ] && return 0
  local ns="$1$$" rc=0
  shift
  ip netns add "$ns" 2>/dev/null || { echo "SKIP: cannot create a network namespace"; exit 77; }
  ip netns exec "$ns" env METAROCE_NETNS="$ns" "$0" "$@" || rc=$?
  ip netns del "$ns"
  exit "$rc"
}
