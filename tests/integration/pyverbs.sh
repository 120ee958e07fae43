#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# rdma-core's own pyverbs tests (Debian python3-pyverbs) against one MetaRoCE device: each test
# connects two QPs of that device in one process (NIC loopback; the RDMA CM tests, two
# processes through librdmacm). Every module of the package's
# tests/ that is not vendor-specific (mlx5, efa) runs, found afresh each time; the skips must be
# exactly the ones docs/conformance.md allows (pyverbs_skips.py), and nothing may fail.
source "$(dirname "$0")/lib.sh"
SRC=/usr/share/doc/rdma-core/tests
[ -f "$SRC/run_tests.py" ] || fail "python3-pyverbs is not installed ($SRC missing)"
HERE=$(cd "$(dirname "$0")" && pwd)
DOC="$HERE/../../docs/conformance.md"
if [ -n "${PYVERBS_MODULES:-}" ]; then
  MODULES=$PYVERBS_MODULES
else
  MODULES=$(find "$SRC" -maxdepth 1 -name 'test_*.py*' -printf '%f\n' | sed 's/\.py\(\.gz\)\?$//' |
    grep -v -E '^test_(mlx5|efa)' | sort -u | tr '\n' ' ')
fi
make_pair
work="$METAROCE_RUNDIR/pyverbs"
mkdir -p "$work"
cp -r "$SRC" "$work/tests"
gunzip -f "$work"/tests/*.gz
# Tests of huge-page regions need 2 MiB pages reserved; as root, reserve a few for the run.
HUGE=/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages
huge_before=""
if [ -w "$HUGE" ] && [ "$(cat "$HUGE")" -eq 0 ]; then
  huge_before=0
  echo 16 >"$HUGE" 2>/dev/null || huge_before=""
fi
# The RDMA CM tests take the address to connect to from a kernel interface of the device, which
# base.py finds under the real /sys/class/infiniband/<dev>/device/net/ and asks `ip` about. As
# root, the run goes into a network namespace of its own holding a veth end named mrA with mrA's
# address (no traffic crosses it: the device is memif, served by the engine through its socket
# file), and a mount namespace where /sys/class is a tmpfs holding just that directory (the
# tests and libibverbs read the device itself through SYSFS_PATH). Elsewhere they skip.
rc=0
ns=""
if [ "$(id -u)" -eq 0 ] && ip netns add "mrpy$$" 2>/dev/null; then
  ns="mrpy$$"
  ip -n "$ns" link add mrA type veth peer name mrA-peer
  ip -n "$ns" addr add 198.18.0.1/24 dev mrA
  ip -n "$ns" link set mrA up
fi
drop_ns() { [ -n "$ns" ] && ip netns del "$ns" 2>/dev/null; ns=""; }
trap 'rc=$?; set +e; drop_ns; (exit $rc); cleanup' EXIT
if [ -n "$ns" ]; then
  # Not under a sanitizer's preloaded runtime (ip, unshare, mount); python gets it back.
  py_preload=${LD_PRELOAD:-}
  LD_PRELOAD= PY_PRELOAD="$py_preload" WORK="$work" MODULES="$MODULES" \
    timeout 900 ip netns exec "$ns" unshare -m --propagation private sh -c '
      mount -t tmpfs metaroce-pyverbs /sys/class &&
      mkdir -p /sys/class/infiniband/mrA/device/net/mrA &&
      cd "$WORK" && LD_PRELOAD="$PY_PRELOAD" /usr/bin/python3 tests/run_tests.py --dev mrA -v $MODULES' \
    >"$LOGDIR/pyverbs" 2>&1 || rc=$?
  drop_ns
else
  (cd "$work" && timeout 900 /usr/bin/python3 tests/run_tests.py --dev mrA -v $MODULES) \
    >"$LOGDIR/pyverbs" 2>&1 || rc=$?
fi
[ -n "$huge_before" ] && echo "$huge_before" >"$HUGE"
grep -E '^(Ran|OK|FAILED)' "$LOGDIR/pyverbs"
check=0
if [ -z "${PYVERBS_MODULES:-}" ]; then
  python3 "$HERE/pyverbs_skips.py" "$LOGDIR/pyverbs" "$DOC" || check=$?
else
  # A subset: each test's outcome is shown, but the table speaks of the whole run.
  grep -E ' \.\.\. ' "$LOGDIR/pyverbs" || true
  python3 "$HERE/pyverbs_skips.py" "$LOGDIR/pyverbs" "$DOC" 2>/dev/null || true
fi
[ "$rc" -eq 0 ] || { grep -E '^(ERROR|FAIL):' "$LOGDIR/pyverbs"; fail "pyverbs tests failed (exit $rc)"; }
grep -q '^OK' "$LOGDIR/pyverbs" || fail "pyverbs did not report OK"
[ "$check" -eq 0 ] || fail "the skips differ from docs/conformance.md (above)"
echo "PASS pyverbs"
