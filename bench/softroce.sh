#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Soft-RoCE (the kernel's rdma_rxe) figures for the benchmark table: boots Debian's own kernel in
# a qemu guest (the team's kernel-guest harness) and runs unmodified ib_write_bw / ib_write_lat /
# ib_send_lat between two rxe devices there. Optional, not in CI: it needs qemu and a kernel
# image download, and minutes of CPU.
#
#   bench/softroce.sh [OUT_DIR]          (default bench/results)
#   KERNEL_GUEST_DIR=/path/to/kernel-guest  (default /work/shared/tools/kernel-guest)
#   SOFTROCE_DUR=5 SOFTROCE_LATN=5000   seconds per bandwidth test, iterations per latency test
#
# Host packages (about 80 MB, hence not in scripts/install-deps):
#   apt-get install --no-install-recommends qemu-system-x86 busybox-static kmod cpio zstd
#
# The guest runs under TCG emulation (this host's /dev/kvm cannot run a stock kernel), where user
# code is about 10x slower than on the host: these figures are NOT comparable with MetaRoCE on the
# host, and the JSON says so. The same md5sum of 64 MiB is timed in the guest and on the host, so
# the slowdown of this run is recorded next to the figures.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/results}
guest=${KERNEL_GUEST_DIR:-/work/shared/tools/kernel-guest}
mkdir -p "$out"

missing=()
for t in qemu-system-x86_64 busybox cpio zstd modprobe; do
  command -v "$t" >/dev/null 2>&1 || missing+=("$t")
done
[ -x "$guest/run.sh" ] || missing+=("$guest/run.sh (set KERNEL_GUEST_DIR)")
if [ "${#missing[@]}" -gt 0 ]; then
  echo "softroce.sh: SKIP, missing: ${missing[*]}" >&2
  echo "  apt-get install --no-install-recommends qemu-system-x86 busybox-static kmod cpio zstd" >&2
  exit 77
fi

work=$(mktemp -d /tmp/metaroce-softroce.XXXXXX)
trap 'rm -rf "$work"' EXIT
log="$out/softroce-guest.log"
# MTU 9000 gives rxe its largest MTU (4096), the closest to what MetaRoCE uses.
KERNEL_GUEST_WORK=${KERNEL_GUEST_WORK:-/tmp/kernel-guest} MTU=9000 \
  TESTS="calib wbw64k wlat slat" DUR=${SOFTROCE_DUR:-5} LATN=${SOFTROCE_LATN:-5000} \
  TIMEOUT=900 LOG="$work/guest.log" "$guest/run.sh" >"$work/run.out" 2>&1 || true
cp "$work/guest.log" "$log" 2>/dev/null || cp "$work/run.out" "$log"

t0=$(date +%s.%N)
dd if=/dev/zero bs=1M count=64 2>/dev/null | md5sum >/dev/null
t1=$(date +%s.%N)
host_calib=$(echo "$t1 - $t0" | bc)

/usr/bin/env python3 - "$log" "$host_calib" "$out/softroce.json" <<'EOF'
import json, re, sys
log, host_calib, out = sys.argv[1], float(sys.argv[2]), sys.argv[3]
text = open(log, errors="replace").read().replace("\r", "")
res = {"experiment": "softroce", "comparable_with_host_figures": False,
       "note": "rdma_rxe between two devices inside a qemu TCG guest (user code ~10x slower than "
               "the host); compare only with software run inside the same guest",
       "host_md5_64MiB_s": host_calib}
m = re.search(r"RESULT calib: md5sum of 64 MiB took ([0-9.]+) s", text)
if m:
    res["guest_md5_64MiB_s"] = float(m.group(1))
    res["guest_slowdown"] = float(m.group(1)) / host_calib if host_calib > 0 else None
def row(name):
    m = re.search(rf"RESULT {name} rc=(\d+)/(\d+): *(.*)", text)
    if not m:
        return None, None
    return (m.group(1) == "0" and m.group(2) == "0"), m.group(3).split()
ok, f = row("wbw64k")
if f and len(f) >= 5:
    res["ib_write_bw_64k_MBps"] = float(f[3])  # perftest's own unit without --report_gbits
    res["ib_write_bw_64k_gbps"] = float(f[3]) * 8 / 1000
    res["ib_write_bw_ok"] = ok
for name, key in (("wlat", "ib_write_lat_2"), ("slat", "ib_send_lat_2")):
    ok, f = row(name)
    if f and len(f) >= 8:
        res[f"{key}_p50_us"], res[f"{key}_p99_us"], res[f"{key}_ok"] = float(f[4]), float(f[7]), ok
json.dump(res, open(out, "w"), indent=1)
print(json.dumps(res, indent=1))
sys.exit(0 if "ib_write_bw_64k_gbps" in res else 1)
EOF
