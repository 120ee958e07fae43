#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# rdma-core's own pyverbs tests (Debian python3-pyverbs) against one MetaRoCE device: each test
# connects two QPs of that device in one process (NIC loopback). Skips must be the honest
# "unsupported" answers listed in docs/conformance.md; anything else fails.
source "$(dirname "$0")/lib.sh"
SRC=/usr/share/doc/rdma-core/tests
[ -f "$SRC/run_tests.py" ] || fail "python3-pyverbs is not installed ($SRC missing)"
MODULES=${PYVERBS_MODULES:-"test_device test_pd test_mr test_cq test_cqex test_qp test_qpex test_atomic test_addr test_cq_events test_fork"}
make_pair
work="$METAROCE_RUNDIR/pyverbs"
mkdir -p "$work"
cp -r "$SRC" "$work/tests"
gunzip -f "$work"/tests/*.gz
rc=0
(cd "$work" && timeout 600 /usr/bin/python3 tests/run_tests.py --dev mrA -v $MODULES) \
  >"$LOGDIR/pyverbs" 2>&1 || rc=$?
grep -E '^(Ran|OK|FAILED)' "$LOGDIR/pyverbs"
echo "skips by reason (each must be listed in docs/conformance.md):"
grep -oE "skipped '[^']*'" "$LOGDIR/pyverbs" | sort | uniq -c | sort -rn
[ "$rc" -eq 0 ] || { grep -E '^(ERROR|FAIL):' "$LOGDIR/pyverbs"; fail "pyverbs tests failed (exit $rc)"; }
grep -q '^OK' "$LOGDIR/pyverbs" || fail "pyverbs did not report OK"
echo "PASS pyverbs"
