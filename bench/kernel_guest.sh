#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# MetaRoCE (kernel/metaroce_ib + the engine) against Soft-RoCE (rdma_rxe) in the same qemu guest
# and the same run: unmodified ib_write_bw 64 KiB and ib_write_lat 2 B between two devices of
# each kind over one veth pair, alternated REPS times (tests/kernel/guest/bench.sh); MetaRoCE
# once per engine idle policy of SPINS. Ratios are what counts: the guest runs under TCG (about
# ten times slower than the host) on a shared machine. A policy of SPINS may name the datapath
# threads' nice value too: adaptive@0 is the adaptive engine with them at nice 0 (its default
# is -10).
#   bench/kernel_guest.sh BUILD_DIR [OUT_DIR]     (default bench/results)
#   KG_MTU=9000 KG_DUR=5 KG_LATN=5000 KG_REPS=3 KG_SPINS=adaptive,always SMP=2
# KG_PROFILE=1 profiles instead (tests/kernel/guest/profile.sh; needs linux-perf): where the CPU
# goes during ib_write_bw 64 KiB over each kind, and the engine thread's system calls.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=$(cd "$1" && pwd)
out=${2:-$here/results}
mkdir -p "$out"
if [ "${KG_PROFILE:-0}" = 1 ]; then
  command -v perf > /dev/null ||
    { echo "kernel_guest.sh: KG_PROFILE needs perf (linux-perf)"; exit 1; }
  export KG_APPEND="kg.mtu=${KG_MTU:-9000} kg.window=${KG_WINDOW:-3}"
  export KG_GUEST_SCRIPT=$here/../tests/kernel/guest/profile.sh
  export KG_EXTRA_BINS="${KG_EXTRA_BINS:-} perf"
  log=$out/kernel-guest-profile.log
  "$here/../tests/kernel/kernel.sh" "$build" > "$log" 2>&1 || true
  grep '^PROFILE' "$log" || { tail -30 "$log"; echo "kernel_guest.sh: no profile"; exit 1; }
  exit 0
fi
export KG_APPEND="kg.mtu=${KG_MTU:-9000} kg.dur=${KG_DUR:-5} kg.latn=${KG_LATN:-5000} kg.reps=${KG_REPS:-3} kg.spins=${KG_SPINS:-adaptive,always}"
export KG_GUEST_SCRIPT=$here/../tests/kernel/guest/bench.sh
log=$out/kernel-guest.log
echo "host: $(nproc) cpus, load $(cut -d' ' -f1-3 /proc/loadavg) before" > "$log"
"$here/../tests/kernel/kernel.sh" "$build" >> "$log" 2>&1 || true
echo "host: load $(cut -d' ' -f1-3 /proc/loadavg) after" >> "$log"
grep -E '^(BENCH|host:)' "$log" || { tail -30 "$log"; echo "kernel_guest.sh: no figures"; exit 1; }
/usr/bin/python3 - "$log" "$out/kernel-guest.json" <<'PY'
import json, re, statistics, sys
text = open(sys.argv[1], errors="replace").read()
runs = {}
for kind, test, rest in re.findall(r"^BENCH (rxe|mr-[\w@-]+) (wbw64k|wlat2) (.*)$", text, re.M):
    f = rest.split()
    if f[0] in ("FAILED", "UNCALIBRATED"):
        continue
    # ib_write_bw: bytes iterations peak average(MB/s) msgrate; ib_write_lat: bytes iterations
    # t_min t_max t_typical t_avg t_stdev 99% 99.9% (usec)
    v = {"MB/s": float(f[3])} if test == "wbw64k" else {
        "min": float(f[2]), "typical": float(f[4]), "avg": float(f[5]), "p99": float(f[7])}
    runs.setdefault(f"{kind} {test}", []).append(v)
config = re.search(r"^BENCH config (.*)$", text, re.M)
res = {"experiment": "kernel-guest", "config": config.group(1) if config else None,
       "host": re.findall(r"^host: (.*)$", text, re.M), "results": {}, "ratios": {}}
def med(key, field):
    vals = [r[field] for r in runs.get(key, [])]
    return statistics.median(vals) if vals else None
for key, vals in sorted(runs.items()):
    fields = vals[0].keys()
    res["results"][key] = {"runs": vals, "median": {k: med(key, k) for k in fields}}
for kind in sorted({k.split()[0] for k in runs if k.startswith("mr-")}):
    bw, bw0 = med(f"{kind} wbw64k", "MB/s"), med("rxe wbw64k", "MB/s")
    lt, lt0 = med(f"{kind} wlat2", "typical"), med("rxe wlat2", "typical")
    lm, lm0 = med(f"{kind} wlat2", "min"), med("rxe wlat2", "min")
    res["ratios"][kind] = {
        "bw_over_rxe": bw / bw0 if bw and bw0 else None,
        "lat_typical_over_rxe": lt / lt0 if lt and lt0 else None,
        "lat_min_over_rxe": lm / lm0 if lm and lm0 else None}
json.dump(res, open(sys.argv[2], "w"), indent=1)
print(json.dumps(res["ratios"], indent=1))
for key, r in res["results"].items():
    print(key, r["median"], "runs", len(r["runs"]))
PY
