#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""bench/gpu/run's last step: gathers the collectives' rows (NAME.jsonl), the case statuses,
the memory probe and bench/run's summary into OUT/results.json, draws OUT/collectives.png (bus bandwidth per
size and case; matplotlib, else gnuplot, else none, said in results.json) and prints a table.

  summarize.py OUT CPU BENCH_RC WALL_S NAME=STATUS...
Exit status: 0 when every case and bench/run succeeded and no result was wrong, else 1.
"""

import glob
import json
import os
import shutil
import subprocess
import sys


def load_rows(path):
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                rows.append(json.loads(line))
    return rows


def plot(out, cases):
    """Writes collectives.png; returns how (or why not)."""
    series = [(name, op, [(r["bytes"], r["busbw_GBs"]) for r in rows if r["op"] == op])
              for name, rows in sorted(cases.items()) for op in sorted({r["op"] for r in rows})]
    series = [s for s in series if s[2]]
    if not series:
        return "no rows to plot"
    png = os.path.join(out, "collectives.png")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(10, 6))
        for name, op, pts in series:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{name} {op}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.set_title("collectives over MetaRoCE (two ranks, two devices)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(png, dpi=100)
        return "matplotlib"
    except ImportError:
        pass
    if shutil.which("gnuplot") is None:
        return "neither matplotlib nor gnuplot: no picture"
    data = []
    for i, (name, op, pts) in enumerate(series):
        path = os.path.join(out, f"plot{i}.dat")
        with open(path, "w") as f:
            f.writelines(f"{b} {v}\n" for b, v in pts)
        data.append(f"'{path}' using 1:2 with linespoints title '{name} {op}'")
    script = (f"set terminal png size 1000,600 noenhanced; set output '{png}'; set logscale x 2; "
              "set format x '%.0b %BB'; set xlabel 'size'; set ylabel 'bus bandwidth (GB/s)'; "
              "set key left top; "
              "set title 'collectives over MetaRoCE (two ranks, two devices)'; plot " + ", ".join(data))
    subprocess.run(["gnuplot", "-e", script], check=True, timeout=60)
    for i in range(len(series)):
        os.remove(os.path.join(out, f"plot{i}.dat"))
    return "gnuplot"


def main():
    out, cpu, bench_rc, wall_s = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), int(sys.argv[4])
    status = dict(s.split("=", 1) for s in sys.argv[5:])
    cases = {os.path.basename(p)[:-len(".jsonl")]: load_rows(p)
             for p in sorted(glob.glob(os.path.join(out, "*.jsonl")))}
    bench = {}
    bench_path = os.path.join(out, "bench", "summary.json")
    if os.path.exists(bench_path):
        with open(bench_path) as f:
            bench = json.load(f)
    with open(os.path.join(out, "machine.json")) as f:
        machine = json.load(f)
    probe = []
    probe_path = os.path.join(out, "memory_probe.json")
    if os.path.exists(probe_path):
        with open(probe_path) as f:
            probe = json.load(f)
    wrong = sum(r.get("wrong", 0) for rows in cases.values() for r in rows)
    failed = [n for n, rc in status.items() if rc != "0"] + ([f"bench/run exit {bench_rc}"] if bench_rc else [])
    picture = plot(out, cases)
    result = {"mode": "cpu (ring all-reduce over verbs)" if cpu else "gpu (NCCL through PyTorch)",
              "machine": machine, "wall_s": wall_s, "case_status": status, "failed": failed,
              "wrong_elements": wrong, "picture": picture, "memory_probe": probe, "collectives": cases,
              "bench": {e: v.get("rows", []) for e, v in bench.get("experiments", {}).items()}}
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"{result['mode']}, {wall_s} s, picture: {picture}")
    for p in probe:
        print(f"  memory: {p['kind']}: {p['maps']}; another process reads it: {p['process_vm_readv']}")
    for name, rows in cases.items():
        best = {}
        for r in rows:
            best[r["op"]] = max(best.get(r["op"], 0), r["busbw_GBs"])
        figures = ", ".join(f"{op} {v:.2f} GB/s" for op, v in sorted(best.items()))
        print(f"  {name} (exit {status.get(name, '?')}): best bus bandwidth {figures or 'none'}")
    for e, rows in result["bench"].items():
        for r in rows:
            print(f"  {e}: {r['figure']}: {r['value']} {r['unit']} (ratio {r['ratio']})")
    if wrong:
        print(f"  WRONG ELEMENTS: {wrong}")
    for f in failed:
        print(f"  FAILED: {f}")
    return 0 if not failed and not wrong else 1


if __name__ == "__main__":
    sys.exit(main())
