#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The direct verbs end to end (tests/integration/dv.cc) over two devices joined by a link of
# four real DPDK ports, one memif pair per plane (`link add --dpdk` once per plane).
source "$(dirname "$0")/lib.sh"
PROG="$BUILD/tests/integration/dv"
[ -x "$PROG" ] || fail "$PROG is not built"
a=() b=()
for p in 0 1 2 3; do
  a+=(--dpdk "net_memif$p,role=server,socket=metaroce-$TEST_NAME-$$-p$p")
  b+=(--dpdk "net_memif$((p + 4)),role=client,socket=metaroce-$TEST_NAME-$$-p$p")
done
"$METAROCE" link add mrA "${a[@]}" --ip 198.18.0.1/24
"$METAROCE" link add mrB "${b[@]}" --ip 198.18.0.2/24
eval "$("$METAROCE" env)"
"$METAROCE" link show mrA --json | grep -q '"planes": 4' || fail "mrA is not a 4-plane link"
# Bad input changes nothing.
if "$METAROCE" link set mrA --plane 4 down 2>"$LOGDIR/bad_plane"; then fail "plane 4 of 4 accepted"; fi
grep -q "planes 0..3" "$LOGDIR/bad_plane" || fail "no reason for plane 4: $(cat "$LOGDIR/bad_plane")"
if "$METAROCE" link set mrA --plane 1 sideways 2>/dev/null; then fail "'sideways' accepted"; fi
if "$METAROCE" link add mrC --dpdk net_memif9,role=server --dpdk net_memif9,role=client \
     --ip 198.18.0.3/24 2>"$LOGDIR/dup"; then fail "one DPDK device for two planes accepted"; fi
timeout 120 "$PROG" --a mrA --b mrB --metaroce "$METAROCE" >"$LOGDIR/dv" 2>&1 ||
  { cat "$LOGDIR/dv"; fail "dv"; }
cat "$LOGDIR/dv"
echo "PASS dv"
