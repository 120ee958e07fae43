#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The first-light benchmark: unmodified ib_write_bw over MetaRoCE (64 KiB and 1 MiB messages,
# two processes, memif) against the physical limit of this machine measured in the same run —
# raw DPDK memif moving 4 KiB packets between two processes. Prints and writes JSON with the ratio.
#   bench/limit.sh BUILD_DIR [SECONDS] [OUT_JSON]
set -euo pipefail
build=$(cd "${1:?usage: $0 BUILD_DIR [SECONDS] [OUT_JSON]}" && pwd)
secs=${2:-5}
out=${3:-}
metaroce="$build/util/metaroce"
export METAROCE_RUNDIR
METAROCE_RUNDIR=$(mktemp -d /tmp/metaroce-bench.XXXXXX)
cleanup() {
  "$metaroce" link del bA >/dev/null 2>&1 || true
  "$metaroce" link del bB >/dev/null 2>&1 || true
  rm -rf "$METAROCE_RUNDIR"
}
trap cleanup EXIT

raw=$(timeout $((secs + 60)) "$build/bench/memif_raw" --size 4096 --seconds "$secs" \
        --socket "metaroce-bench-raw-$$" | tail -n 1)
raw_gbps=$(sed -n 's/.*"gbps": *\([0-9.e+-]*\).*/\1/p' <<<"$raw")
[ -n "$raw_gbps" ] || { echo "limit.sh: memif_raw printed no gbps: $raw" >&2; exit 1; }

sock="metaroce-bench-$$"
"$metaroce" link add bA --dpdk "net_memif0,role=server,socket=$sock" --ip 198.18.1.1/24 >/dev/null
"$metaroce" link add bB --dpdk "net_memif1,role=client,socket=$sock" --ip 198.18.1.2/24 >/dev/null
eval "$("$metaroce" env)"

# ib_write_bw SIZE PORT -> average Gbit/s
write_bw() {
  local size=$1 port=$2 log
  log=$(mktemp)
  timeout $((secs + 60)) ib_write_bw -d bA -x 0 -p "$port" -s "$size" -D "$secs" --report_gbits \
    >"$log.server" 2>&1 &
  local spid=$!
  for _ in $(seq 100); do ss -ltnH "sport = :$port" | grep -q . && break; sleep 0.1; done
  timeout $((secs + 60)) ib_write_bw -d bB -x 0 -p "$port" -s "$size" -D "$secs" --report_gbits \
    127.0.0.1 >"$log" 2>&1 || { cat "$log" "$log.server" >&2; kill "$spid" 2>/dev/null; return 1; }
  wait "$spid" || true
  awk -v s="$size" '$1 == s && NF >= 5 { v = $4 } END { if (v == "") exit 1; print v }' "$log"
  rm -f "$log" "$log.server"
}
bw64=$(write_bw 65536 18700)
bw1m=$(write_bw 1048576 18701)

json=$(printf '{"seconds": %s, "memif_raw_4k_gbps": %s, "ib_write_bw_64k_gbps": %s, "ib_write_bw_1m_gbps": %s, "ratio_64k": %s, "ratio_1m": %s, "memif_raw": %s}' \
  "$secs" "$raw_gbps" "$bw64" "$bw1m" \
  "$(awk -v a="$bw64" -v b="$raw_gbps" 'BEGIN { printf "%.3f", a / b }')" \
  "$(awk -v a="$bw1m" -v b="$raw_gbps" 'BEGIN { printf "%.3f", a / b }')" "$raw")
echo "$json"
[ -z "$out" ] || echo "$json" >"$out"
