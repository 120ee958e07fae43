#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The perftest patch series (perftest-patches/) apply without fuzz and build: master's against
# this build tree's libmetaroce (the --mrdv_* options are there), 4.5-0.17's without MetaRoCE at
# all (the patched tree builds as before and has none of them). Both builds are kept in
# BUILD/perftest between runs. Usage: perftest_patches.sh BUILD_DIR.
set -euo pipefail
BUILD=$(cd "${1:?usage: $0 BUILD_DIR}" && pwd)
REPO=$(cd "$(dirname "$0")/../.." && pwd)
BP="$REPO/scripts/build-perftest"
fail() { echo "FAIL perftest_patches: $*" >&2; exit 1; }
for tree in master 4.5-0.17; do
  why=$("$BP" --tree "$tree" --find-tarball 2>&1 >/dev/null) ||
    { echo "SKIP: no perftest $tree tarball: $why"; exit 77; }
done

# help DIR: what DIR's ib_write_bw --help says (perftest's --help exits 1).
help() { "$1/ib_write_bw" --help 2>&1 || true; }

out="$BUILD/perftest/master"
"$BP" --tree master --out "$out" --metaroce-build "$BUILD" || fail "master series with MetaRoCE"
for opt in --mrdv_planes --mrdv_paths --mrdv_isolated --mrdv_stats; do
  help "$out" | grep -q -- "$opt" || fail "master: ib_write_bw --help lacks $opt"
done
grep -q '^#define HAVE_METAROCE_DV 1' "$out/src/config.h" || fail "master: no HAVE_METAROCE_DV"
echo "ok: the master series applies and builds with MetaRoCE direct verbs"

out="$BUILD/perftest/4.5-0.17-plain"
"$BP" --tree 4.5-0.17 --out "$out" --no-metaroce || fail "4.5-0.17 series without MetaRoCE"
if help "$out" | grep -q -- --mrdv; then fail "4.5-0.17 without MetaRoCE offers --mrdv_* options"; fi
if grep -q "^#define HAVE_METAROCE_DV" "$out/src/config.h"; then fail "4.5-0.17: HAVE_METAROCE_DV without it"; fi
if ldd "$out/ib_write_bw" | grep -q libmetaroce; then fail "4.5-0.17: linked to libmetaroce"; fi
echo "ok: the 4.5-0.17 series without MetaRoCE builds as perftest did"
echo "PASS perftest_patches"
