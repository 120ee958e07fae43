#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# perftest 4.5-0.17 with the MetaRoCE patches (perftest-patches/, built by scripts/build-perftest
# into BUILD/perftest/4.5-0.17 once) over two devices on a 4-plane fabric emulator:
# (1) without the new options it runs as the unpatched perftest does, and prints no telemetry;
# (2) --mrdv_planes=0x6: the per-path table of the client shows bytes only on planes 1 and 2,
# both of them; (3) the same while plane 2 goes down for a second mid-run (the fabric drops
# frames there): both sides exit 0 and still nothing crossed planes 0 and 3; (4) options a
# device cannot honour are refused before anything runs. Usage: perftest_planes.sh BUILD_DIR.
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/lib.sh"
REPO=$(cd "$HERE/../.." && pwd)
[ -x "$BUILD/datapath/fabric/fabric_probe" ] || { echo "SKIP: built without DPDK"; exit 77; }
"$REPO/scripts/build-perftest" --tree 4.5-0.17 --find-tarball >/dev/null 2>"$LOGDIR/tarball" ||
  { echo "SKIP: no perftest tarball: $(cat "$LOGDIR/tarball")"; exit 77; }
PY=/usr/bin/python3
[ -x "$PY" ] || PY=python3
FAB="pp$$"
PORT=18700
MASK=0x6     # planes 1 and 2 of 0..3
DOWN=2       # the masked plane that fails mid-run

stop_all() { fabric_pair_stop "$FAB"; }
# cleanup (lib.sh) exits with the status it finds in $?: hand it the script's, not stop_all's.
trap 'rc=$?; set +e; stop_all; (exit "$rc"); cleanup' EXIT

# The patched perftest, built against this build tree; kept between runs (the script's stamp).
PT="$BUILD/perftest/4.5-0.17"
"$REPO/scripts/build-perftest" --tree 4.5-0.17 --out "$PT" --metaroce-build "$BUILD" \
  >"$LOGDIR/build-perftest" 2>&1 || { cat "$LOGDIR/build-perftest"; fail "build-perftest"; }
tail -n 1 "$LOGDIR/build-perftest"
BW="$PT/ib_write_bw"
"$BW" --help >"$LOGDIR/help" 2>&1 || true   # perftest's --help exits 1
grep -q -- '--mrdv_planes' "$LOGDIR/help" || fail "$BW was built without MetaRoCE support"

fabric_pair "$FAB" 4 2 3

# bw NAME ARGS...: the patched ib_write_bw, server on fA, client on fB, both must exit 0.
bw() {
  local name=$1
  shift
  PORT=$((PORT + 1))
  run_pair "$name" "$PORT" 240 -- "$BW" -d fA -x 0 -p "$PORT" "$@" \
    -- "$BW" -d fB -x 0 -p "$PORT" "$@" 127.0.0.1
  grep -qE '^ +65536 +[0-9]+ ' "$LOGDIR/$name.client" || fail "$name: no result line"
}

# planes LOG MASK [require]: from LOG's path table, bytes went out only on the planes of MASK;
# with "require", on every one of them, and the client's tables add up to something.
planes() {
  "$PY" - "$@" <<'EOF' || fail "$1: traffic outside plane mask $2 (table above)"
import re, sys
log, mask = sys.argv[1], int(sys.argv[2], 0)
require = len(sys.argv) > 3
row = re.compile(r"^ +(\d+) +(\d+) +(\d+) +([a-z_]+) +[\d.]+ +[\d.]+ +\d+ +(\d+) +(\d+) +\d+ +\d+ +\d+$")
paths, per_plane, tables = [], {}, 0
for line in open(log):
    if line.startswith(" MetaRoCE paths of QP"):
        tables += 1
    m = row.match(line)
    if m:
        paths.append((int(m[1]), int(m[2]), m[4], int(m[6])))
    if line.startswith(" MetaRoCE tx bytes per plane :"):
        for item in line.split(":", 1)[1].split():
            p, b = item.split(":")
            per_plane[int(p)] = per_plane.get(int(p), 0) + int(b)
def masked(plane):
    return (mask >> plane) & 1 == 1
ok = tables > 0 and bool(paths) and bool(per_plane)
for pid, plane, state, tx in paths:
    if tx > 0 and not masked(plane):
        print(f"path {pid} on plane {plane} ({state}) sent {tx} bytes", file=sys.stderr)
        ok = False
for plane, b in sorted(per_plane.items()):
    if (b > 0 and not masked(plane)) or (require and b == 0 and masked(plane)):
        print(f"plane {plane}: {b} bytes", file=sys.stderr)
        ok = False
missing = [p for p in range(32) if masked(p) and p not in per_plane]
if require and missing:
    print(f"planes {missing} of the mask missing from the summary", file=sys.stderr)
    ok = False
if not ok:
    print(f"{log}: {tables} tables, paths {paths}, bytes per plane {per_plane}", file=sys.stderr)
    print("".join(l for l in open(log) if "MetaRoCE" in l or row.match(l)), file=sys.stderr)
sys.exit(0 if ok else 1)
EOF
}

# 1. Without the new options the patched perftest is the perftest it was.
bw plain -s 65536 -n 500
! grep -q "MetaRoCE" "$LOGDIR/plain.server" "$LOGDIR/plain.client" ||
  fail "plain: telemetry without --mrdv_* options"
echo "ok: without --mrdv_* options, ib_write_bw runs and prints what it always printed"

# 2. A plane mask: only those planes carry the test's bytes.
bw masked -s 65536 -n 2000 --mrdv_planes=$MASK
sed -n '/MetaRoCE paths of QP/,/MetaRoCE tx bytes per plane/p' "$LOGDIR/masked.client"
planes "$LOGDIR/masked.client" $MASK require
planes "$LOGDIR/masked.server" $MASK
echo "ok: --mrdv_planes=$MASK: bytes on planes 1 and 2 only, on both"

# 3. One masked plane down for a second while the run's traffic flows, then up again.
edge() {  # FIELD [PLANE]: FIELD summed over the edge links (of PLANE)
  "$METAROCE" fabric stat "$FAB" --json | "$PY" -c '
import json, sys
f, p = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None
print(sum(l[f] for l in json.load(sys.stdin)["links"]
          if l["kind"] == "edge" and (p is None or l["plane"] == int(p))))' "$@"
}
lost() { "$METAROCE" fabric stat "$FAB" --json | "$PY" -c '
import json, sys
print(sum(l["drop_down"] for l in json.load(sys.stdin)["links"] if l["plane"] == int(sys.argv[1])))' "$1"; }
fault() {
  local start
  start=$(edge frames_out)
  for _ in $(seq 600); do
    [ "$(( $(edge frames_out) - start ))" -ge 500 ] && break
    sleep 0.1
  done
  "$METAROCE" fabric set "$FAB" --plane $DOWN down
  sleep 1
  "$METAROCE" fabric set "$FAB" --plane $DOWN up
}
before=$(lost $DOWN)
fault >"$LOGDIR/fault.log" 2>&1 &
FAULT_PID=$!
bw plane-down -s 65536 -D 6 --mrdv_planes=$MASK
wait "$FAULT_PID" || fail "the fault was not injected: $(cat "$LOGDIR/fault.log")"
FAULT_PID=""
hit=$(( $(lost $DOWN) - before ))
[ "$hit" -gt 0 ] || fail "plane $DOWN went down while nothing crossed it (the run missed the fault)"
sed -n '/MetaRoCE paths of QP/,/MetaRoCE tx bytes per plane/p' "$LOGDIR/plane-down.client"
planes "$LOGDIR/plane-down.client" $MASK
planes "$LOGDIR/plane-down.server" $MASK
echo "ok: plane $DOWN down mid-run ($hit frames lost there): both sides exit 0, planes 0 and 3 unused"

# 4. What the device cannot honour is refused before any connection is made.
refused() {  # WHAT PATTERN ARGS...: the server alone exits non-zero, saying PATTERN
  local what=$1 pattern=$2
  shift 2
  if timeout 60 "$BW" -d fA -x 0 -p $((PORT + 100)) "$@" >"$LOGDIR/refused" 2>&1; then
    fail "$what accepted"
  fi
  grep -q "$pattern" "$LOGDIR/refused" || fail "$what: no reason given: $(cat "$LOGDIR/refused")"
}
refused "a plane the device lacks" "plane mask 0x10 doesn't fit fA" --mrdv_planes=0x10
refused "--mrdv_planes on UC" "supported only on RC" -c UC --mrdv_planes=0x3
refused "an empty plane mask" "plane mask should be between" --mrdv_planes=0
echo "ok: a plane fA lacks, UC and an empty mask are refused"
echo "PASS perftest_planes"
