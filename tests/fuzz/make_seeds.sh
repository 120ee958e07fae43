#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Regenerates tests/fuzz/corpus/wire/ from the real encoders (make_seeds.cc). The transport
# target's seeds are inputs kept from fuzzing runs (libFuzzer -merge=1); see docs/security.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=tests/fuzz/corpus/wire
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"${CXX:-c++}" -std=c++20 -I. tests/fuzz/make_seeds.cc datapath/wire/frame.cc datapath/wire/mrh.cc \
  -o "$tmp/make_seeds"
mkdir -p "$out"
"$tmp/make_seeds" "$out"
ls "$out"
