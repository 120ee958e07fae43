#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The seed's experiments in the simulator, MetaRoCE and RoCEv2 side by side (docs/simulation.md).

    sim/experiments.py build/sim/metaroce-sim OUTDIR [--only NAME ...] [--quick]

Runs each experiment's scenarios one after another (they are deterministic: the same binary gives
the same figures on any machine; only wall_s differs), writes OUTDIR/NAME.json with every run's
arguments and output, OUTDIR/NAME.dat for gnuplot, and OUTDIR/NAME.svg when gnuplot is installed.
--quick: 16 hosts instead of 64, for a look in seconds.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

FABRIC64 = ["--hosts", "64", "--hosts-per-leaf", "8", "--spines", "8"]
FABRIC16 = ["--hosts", "16", "--hosts-per-leaf", "4", "--spines", "4"]
G400 = ["--gbps", "400", "--host-gbps", "400"]
G100 = ["--gbps", "100", "--host-gbps", "100"]
LOSSES = [0, 0.001, 0.01, 0.05, 0.1]
ROCE_LIMIT = ["--limit-ms", "200"]  # RoCEv2 under heavy loss: report what finished by then


def run(sim, args):
    p = subprocess.run([sim] + args, capture_output=True, text=True, timeout=1800)
    try:
        out = json.loads(p.stdout)
    except json.JSONDecodeError:
        sys.exit(f"metaroce-sim {' '.join(args)} printed no result:\n{p.stderr}")
    out["args"] = args
    print(f"  {' '.join(args)}\n    -> completion {out['completion_us']} us, unfinished "
          f"{out['unfinished']}, wall {out['wall_s']} s", flush=True)
    return out


# Ours without the tail mechanisms of congestion.md §5.1-§5.2 and with one tail probe: the
# transport as it was before the loss experiments changed it, for comparison.
BASIC = ["--late-detection", "off", "--tail-redundancy", "off", "--tail-probes", "1"]


def collective(sim, fabric, workload, kib):
    """All-reduce or all-to-all at each loss rate: ours, ours without its tail mechanisms,
    RoCEv2."""
    rows = []
    base = fabric + G400 + ["--paths", "8", "--workload", workload, "--flow-kib", str(kib)]
    for loss in LOSSES:
        row = {"loss": loss}
        for name, extra in [("metaroce", []), ("metaroce_basic", BASIC),
                            ("rocev2", ["--transport", "rocev2"] + ROCE_LIMIT)]:
            row[name] = run(sim, base + ["--loss", str(loss)] + extra)
        rows.append(row)
    for name in ["metaroce", "metaroce_basic", "rocev2"]:
        clean = rows[0][name]["completion_us"]
        for r in rows:
            r[name]["kept"] = (clean / r[name]["completion_us"]
                               if r[name]["completion_us"] and not r[name]["unfinished"] else 0)
    return rows


def planes(sim, fabric, kib):
    """P = 1, 2, 4, 8 planes, 8 paths per plane, 100 Gbit/s: a permutation whose flows grow with
    P (each plane carries the same), the same with fixed flows, and all-to-all (N(N-1)
    connections)."""
    rows = []
    for p in [1, 2, 4, 8]:
        base = fabric + G100 + ["--planes", str(p), "--paths", str(8 * p)]
        rows.append({
            "planes": p,
            "scaled": run(sim, base + ["--flow-kib", str(kib * p)]),
            "fixed": run(sim, base + ["--flow-kib", str(kib)]),
            "alltoall": run(sim, base + ["--workload", "alltoall", "--flow-kib", str(kib * p)]),
            "rocev2": run(sim, base[:-2] + ["--transport", "rocev2", "--flow-kib", str(kib * p)]
                          + ROCE_LIMIT),
        })
    for kind in ["scaled", "fixed", "alltoall", "rocev2"]:
        one = rows[0][kind]["goodput_gbps"]
        for r in rows:
            r[kind]["of_linear"] = r[kind]["goodput_gbps"] / (one * r["planes"]) if one else 0
    return rows


def incast(sim, fabric, kib, out):
    """63:1 (or 15:1) incast; Jain's index over 80 us windows sliding by one base RTT; the
    series of the cases named in INCAST_PLOT go to OUT/incast-SLUG.dat for the plot."""
    base = fabric + G400 + ["--paths", "8", "--workload", "incast", "--flow-kib", str(kib)]
    cases = [
        ("metaroce, no hints", []),
        ("metaroce, hints", ["--rx-capacity-gbps", "400"]),
        ("metaroce, hints, no start window", ["--rx-capacity-gbps", "400", "--start-window", "0"]),
        ("metaroce, hints every 8 us", ["--rx-capacity-gbps", "400", "--hint-interval-us", "8"]),
        ("metaroce, hints, PFC", ["--rx-capacity-gbps", "400", "--pfc"]),
        ("rocev2", ["--transport", "rocev2"] + ROCE_LIMIT),
        ("rocev2, PFC", ["--transport", "rocev2", "--pfc"] + ROCE_LIMIT),
    ]
    rows = []
    for name, extra in cases:
        series = []
        if name in INCAST_PLOT:
            series = ["--fair-series", os.path.join(out, "incast-" + INCAST_PLOT[name] + ".dat")]
        rows.append({"case": name, "run": run(sim, base + extra + ["--fair-window-us", "80"] + series)})
    return rows


INCAST_PLOT = {"metaroce, hints": "hints", "metaroce, hints, no start window": "no-start-window",
               "metaroce, no hints": "no-hints", "rocev2, PFC": "rocev2-pfc"}


def plot_incast(out):
    """Jain's index per window against the window's start, in base RTTs (8 us), first 320 us."""
    if not shutil.which("gnuplot"):
        return
    cmds = [
        "set terminal svg size 640,400 dynamic font 'sans,11'",
        f"set output '{os.path.join(out, 'incast.svg')}'",
        "set title \"63:1 incast: Jain's index over 80 us windows (64 hosts, 400 Gbit/s)\"",
        "set xlabel 'window start (base RTTs of 8 us)'", "set ylabel \"Jain's index\"",
        "set key bottom right", "set grid", "set yrange [0:1.05]", "set xrange [0:40]",
        "set arrow from 2, graph 0 to 2, graph 1 nohead dt 2",
    ]
    lines = []
    for name, slug in INCAST_PLOT.items():
        dat = os.path.join(out, "incast-" + slug + ".dat")
        if os.path.exists(dat):
            lines.append(f"'{dat}' using ($1 / 8):2 with lines lw 2 title '{name}'")
    cmds.append("plot " + ", ".join(lines))
    subprocess.run(["gnuplot"], input="\n".join(cmds) + "\n", text=True, check=True)


def failure(sim, fabric, kib):
    base = fabric + G400 + ["--paths", "8", "--workload", "allreduce", "--flow-kib", str(kib)]
    rows = []
    at_us = None
    for name, extra in [("metaroce", []), ("rocev2", ["--transport", "rocev2", "--limit-ms", "20"])]:
        clean = run(sim, base + extra)
        at_us = at_us or round(clean["completion_us"] / 3)  # a third into ours, for both
        failed = run(sim, base + extra + ["--fail-core-link-at-us", str(at_us)])
        rows.append({"transport": name, "fail_at_us": at_us, "clean": clean, "failed": failed})
    return rows


def write_dat(out, name, header, lines):
    with open(os.path.join(out, name + ".dat"), "w") as f:
        f.write("# " + header + "\n")
        for line in lines:
            f.write(" ".join(str(x) for x in line) + "\n")


PLOTS = {
    "allreduce": ("All-reduce throughput kept under random loss (64 hosts, 400 Gbit/s)",
                  "loss on every core link (%)", "kept (of the run without loss)",
                  [(2, "MetaRoCE"), (3, "MetaRoCE without late detection, redundancy"),
                   (4, "RoCEv2")], True),
    "alltoall": ("All-to-all throughput kept under random loss (64 hosts, 400 Gbit/s)",
                 "loss on every core link (%)", "kept (of the run without loss)",
                 [(2, "MetaRoCE"), (3, "MetaRoCE without late detection, redundancy"),
                  (4, "RoCEv2")], True),
    "planes": ("Goodput against planes (64 hosts, 100 Gbit/s per plane)", "planes",
               "of P x one plane", [(2, "MetaRoCE permutation"), (3, "MetaRoCE, fixed flows"),
                                    (4, "MetaRoCE all-to-all"), (5, "RoCEv2, a QP per plane")],
               False),
}


def plot(out, name):
    if name not in PLOTS or not shutil.which("gnuplot"):
        return
    title, xl, yl, series, logx = PLOTS[name]
    dat = os.path.join(out, name + ".dat")
    cmds = [
        "set terminal svg size 640,400 dynamic font 'sans,11'",
        f"set output '{os.path.join(out, name + '.svg')}'",
        f"set title '{title}'", f"set xlabel '{xl}'", f"set ylabel '{yl}'",
        "set key bottom left" if logx else "set key top right", "set grid", "set yrange [0:1.15]",
    ]
    if logx:
        cmds += ["set logscale x", "set xrange [0.05:20]"]
    else:
        cmds += ["set xrange [0.5:8.5]", "set xtics (1, 2, 4, 8)"]
    xcol = "($1 == 0 ? 0.07 : $1)" if logx else "1"
    cmds.append("plot " + ", ".join(
        f"'{dat}' using {xcol}:{col} with linespoints title '{t}'" for col, t in series))
    subprocess.run(["gnuplot"], input="\n".join(cmds) + "\n", text=True, check=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("sim")
    ap.add_argument("out")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    fabric = FABRIC16 if a.quick else FABRIC64
    exps = {
        "allreduce": lambda: collective(a.sim, fabric, "allreduce", 16384 if a.quick else 65536),
        "alltoall": lambda: collective(a.sim, fabric, "alltoall", 4096 if a.quick else 16384),
        "planes": lambda: planes(a.sim, fabric, 4096 if a.quick else 16384),
        "incast": lambda: incast(a.sim, fabric, 1024, a.out),
        "failure": lambda: failure(a.sim, fabric, 16384 if a.quick else 65536),
    }
    for name, fn in exps.items():
        if a.only and name not in a.only:
            continue
        print(f"{name}:", flush=True)
        rows = fn()
        with open(os.path.join(a.out, name + ".json"), "w") as f:
            json.dump(rows, f, indent=1)
        if name in ("allreduce", "alltoall"):
            write_dat(a.out, name, "loss% metaroce metaroce_basic rocev2 (kept)",
                      [(r["loss"] * 100, round(r["metaroce"]["kept"], 4),
                        round(r["metaroce_basic"]["kept"], 4), round(r["rocev2"]["kept"], 4))
                       for r in rows])
        elif name == "planes":
            write_dat(a.out, name, "planes scaled fixed alltoall rocev2 (of linear)",
                      [(r["planes"], round(r["scaled"]["of_linear"], 4),
                        round(r["fixed"]["of_linear"], 4), round(r["alltoall"]["of_linear"], 4),
                        round(r["rocev2"]["of_linear"], 4)) for r in rows])
        plot(a.out, name)
        if name == "incast":
            plot_incast(a.out)


if __name__ == "__main__":
    main()
