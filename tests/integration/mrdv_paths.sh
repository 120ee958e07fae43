#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The direct-verbs example (examples/mrdv_paths.c) over a link: an RC queue pair with 4 paths
# and a plane mask, looped back to a second one on the same device, writes and checks its data,
# and shows its connection and paths; then refusals of bad attributes.
source "$(dirname "$0")/lib.sh"
EXAMPLE="$BUILD/examples/mrdv_paths"
[ -x "$EXAMPLE" ] || { echo "SKIP mrdv_paths: built without the provider"; exit 77; }
make_pair
out="$LOGDIR/mrdv_paths"
timeout 60 "$EXAMPLE" -d mrA -p 4 -m 0x1 -n 300 >"$out" 2>&1 || { cat "$out"; fail "mrdv_paths failed"; }
cat "$out"
grep -q '^device mrA: wire version 1, 1 plane(s)' "$out" || fail "mrdv_query_device was not printed"
[ "$(grep -c '^round [12]: 300 writes of 4096 bytes in .* data checked$' "$out")" -eq 2 ] ||
  fail "not every round of writes was checked"
# The connection goes to the device's own address, with the 4 paths asked for, on plane 0.
grep -q '^qp 0x[0-9a-f]*: connection 0x[0-9a-f]* lane [0-9]* to 198\.18\.0\.1, [0-9]* of 4 paths active, planes 0x1,' "$out" ||
  fail "mrdv_query_qp_conn does not show 4 paths on plane 0 to 198.18.0.1"
[ "$(grep -cE '^ +[0-3] +[0-9]+ +0 +(active|failed|probing|down) ' "$out")" -eq 8 ] ||
  fail "mrdv_query_paths did not list paths 0-3 on plane 0 twice"
grep -qE '^repath: path 0 moved from UDP source port [0-9]+ to [0-9]+$' "$out" || fail "mrdv_repath was not shown"
grep -q '^mrdv_paths: OK$' "$out" || fail "mrdv_paths did not finish"
# Bad attributes are refused as the header documents: no path, a plane the device lacks.
for bad in "-p 0" "-m 0x2"; do
  # shellcheck disable=SC2086  # the options are meant to split
  if timeout 30 "$EXAMPLE" -d mrA $bad -n 1 >"$LOGDIR/bad" 2>&1; then fail "mrdv_paths $bad succeeded"; fi
  grep -q 'mrdv_create_qp: Invalid argument' "$LOGDIR/bad" ||
    fail "mrdv_paths $bad: not EINVAL from mrdv_create_qp: $(cat "$LOGDIR/bad")"
done
echo "PASS mrdv_paths"
