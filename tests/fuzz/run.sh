#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Runs one libFuzzer target for a bounded time: run.sh TARGET SEED_DIR SECONDS. Every seed (and
# so every committed regression input) runs first; new inputs go to a scratch corpus, never into
# the repository. Fails on a crash, a sanitizer report, a leak, a timeout or a broken invariant,
# and prints the input that did it in base64, to be added to SEED_DIR with the fix.
set -euo pipefail
target=$1 seeds=$2 seconds=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/corpus"
rc=0
"$target" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
  -artifact_prefix="$work/" "$work/corpus" "$seeds" >"$work/log" 2>&1 || rc=$?
grep -E '^(stat::number_of_executed_units|stat::average_exec_per_sec|stat::new_units_added|Done)' \
  "$work/log" || true
echo "corpus: $(ls "$seeds" | wc -l) seeds, $(ls "$work/corpus" | wc -l) new inputs"
if [ "$rc" -ne 0 ]; then
  tail -n 80 "$work/log"
  for f in "$work"/crash-* "$work"/leak-* "$work"/timeout-* "$work"/oom-*; do
    [ -e "$f" ] || continue
    echo "$(basename "$f"), base64 (add it to $seeds with the fix):"
    base64 -w0 "$f"
    echo
  done
  exit 1
fi
