#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The first-light benchmark, now the `limit` experiment of bench/run: unmodified ib_write_bw over
# MetaRoCE (64 KiB and 1 MiB, directly and through the fabric) against raw DPDK memif 4 KiB
# measured in the same run. Prints the experiment's JSON.
#   bench/limit.sh BUILD_DIR [--quick] [OUT_DIR]
set -euo pipefail
build=${1:?usage: $0 BUILD_DIR [--quick] [OUT_DIR]}
quick=()
[ "${2:-}" = "--quick" ] && { quick=(--quick); shift; }
if [ -n "${2:-}" ]; then
  out=$2
else
  out=$(mktemp -d /tmp/metaroce-limit.XXXXXX)
  trap 'rm -rf "$out"' EXIT
fi
"$(dirname "$0")/run" "${quick[@]}" --only limit --out "$out" "$build" >&2
cat "$out/limit.json"
