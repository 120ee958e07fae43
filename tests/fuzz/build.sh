#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds one libFuzzer target: build.sh CLANGXX SRCROOT OUT DEPFILE SOURCE... [-- FLAG...]
# (FLAGs: extra compiler and linker flags, e.g. a library's include path and -l options).
# Every source is compiled with the fuzzer's coverage and ASan/UBSan (so the code under test is
# instrumented, not only the target), then linked with libFuzzer's main. DEPFILE lists every
# header the sources include, so that ninja rebuilds the target when one changes.
set -euo pipefail
cxx=$1 root=$2 out=$3 depfile=$4
shift 4
srcs=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do srcs+=("$1"); shift; done
[ $# -gt 0 ] && shift
extra=("$@")
flags=(-std=c++20 -O1 -g -fno-omit-frame-pointer -D_GNU_SOURCE -I"$root"
       -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined)
objdir="$out.objs"
rm -rf "$objdir"
mkdir -p "$objdir"
objs=()
deps=()
for src in "${srcs[@]}"; do
  obj="$objdir/$(basename "$src").o"
  "$cxx" "${flags[@]}" "${extra[@]}" -MMD -MF "$obj.d" -c "$src" -o "$obj"
  objs+=("$obj")
  # The compiler's rule is "obj: deps \<newline> deps ..."; keep the deps.
  deps+=($(sed -e 's/^[^:]*://' -e 's/\\$//' "$obj.d"))
done
"$cxx" "${flags[@]}" "${objs[@]}" "${extra[@]}" -o "$out"
printf '%s:' "$out" >"$depfile"
printf ' %s' "${deps[@]}" >>"$depfile"
printf '\n' >>"$depfile"
