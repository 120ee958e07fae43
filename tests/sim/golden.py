#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Golden scenarios of the simulator (meson test --suite sim).

  golden.py METAROCE_SIM GOLDEN_DIR [--update] [NAME...]

Runs each scenario twice: the two runs must agree exactly (one seed, one result), and the
figures must equal the committed ones in GOLDEN_DIR/NAME.json. A change to the transport that
moves a figure fails here with every old and new value printed; if the change is meant, rerun
with --update and commit the new files with it.
"""
import json
import os
import subprocess
import sys

SCENARIOS = {
    # 16 hosts, 4 leaves, 4 spines, 400 Gbit/s: a random permutation of 1 MiB flows.
    "permutation16": ["--hosts", "16", "--hosts-per-leaf", "4", "--spines", "4",
                      "--flow-kib", "1024"],
    # The same on 4 planes (8 paths per plane).
    "planes4": ["--hosts", "16", "--hosts-per-leaf", "4", "--spines", "2", "--planes", "4",
                "--paths", "32", "--flow-kib", "1024"],
    # 7 senders into one host behind one leaf.
    "incast8": ["--hosts", "8", "--hosts-per-leaf", "8", "--spines", "1", "--workload",
                "incast", "--flow-kib", "512"],
    # 1 % random loss on every leaf-spine link.
    "loss1": ["--hosts", "16", "--hosts-per-leaf", "4", "--spines", "4", "--flow-kib", "1024",
              "--loss", "0.01"],
    # 5 % loss, with three tail probes before the RTO (the default) and with one.
    "loss5": ["--hosts", "16", "--hosts-per-leaf", "4", "--spines", "4", "--flow-kib",
              "1024", "--loss", "0.05"],
    "loss5_tlp1": ["--hosts", "16", "--hosts-per-leaf", "4", "--spines", "4", "--flow-kib",
                   "1024", "--loss", "0.05", "--tail-probes", "1"],
    # The RoCEv2 baseline (go-back-N, DCQCN, one path per QP) on the same permutation, and at
    # 1 % loss.
    "rocev2_permutation16": ["--transport", "rocev2", "--hosts", "16", "--hosts-per-leaf", "4",
                             "--spines", "4", "--flow-kib", "1024"],
    "rocev2_loss1": ["--transport", "rocev2", "--hosts", "16", "--hosts-per-leaf", "4",
                     "--spines", "4", "--flow-kib", "1024", "--loss", "0.01"],
    # Ring all-reduce of 4 MiB per host over 16 hosts, clean and at 1 % loss, and all-to-all.
    "allreduce16": ["--workload", "allreduce", "--hosts", "16", "--hosts-per-leaf", "4",
                    "--spines", "4", "--flow-kib", "4096"],
    "allreduce16_loss1": ["--workload", "allreduce", "--hosts", "16", "--hosts-per-leaf", "4",
                          "--spines", "4", "--flow-kib", "4096", "--loss", "0.01"],
    "alltoall16": ["--workload", "alltoall", "--hosts", "16", "--hosts-per-leaf", "4",
                   "--spines", "4", "--flow-kib", "1024"],
    # The all-reduce at 10 % loss: late detection, paced resends and tail redundancy at work.
    "allreduce16_loss10": ["--workload", "allreduce", "--hosts", "16", "--hosts-per-leaf", "4",
                           "--spines", "4", "--flow-kib", "4096", "--loss", "0.1"],
    # A 15:1 incast with receivers' shares (hints): start window, immediate shares and pushes.
    "incast16_hints": ["--hosts", "16", "--hosts-per-leaf", "4", "--spines", "4", "--workload",
                       "incast", "--flow-kib", "1024", "--rx-capacity-gbps", "400"],
    # A leaf-spine link fails 20 us into the permutation.
    "core_failure": ["--hosts", "16", "--hosts-per-leaf", "4", "--spines", "4", "--flow-kib",
                     "2048", "--fail-core-link-at-us", "20"],
    # A 15:1 incast of 1 MiB each over a lossless fabric (PFC), RoCEv2 and ours: no drops.
    "rocev2_incast16_pfc": ["--transport", "rocev2", "--hosts", "16", "--hosts-per-leaf", "4",
                            "--spines", "4", "--workload", "incast", "--flow-kib", "1024",
                            "--pfc"],
    "incast16_pfc": ["--hosts", "16", "--hosts-per-leaf", "4", "--spines", "4", "--workload",
                     "incast", "--flow-kib", "1024", "--pfc"],
    # A k = 4 fat-tree (16 hosts, 20 switches): the permutation over ours and RoCEv2, and the
    # busiest aggregation-core link failing 20 us in.
    "fattree4": ["--topology", "fattree", "--k", "4", "--flow-kib", "1024"],
    "rocev2_fattree4": ["--transport", "rocev2", "--topology", "fattree", "--k", "4",
                        "--flow-kib", "1024"],
    "fattree4_core_failure": ["--topology", "fattree", "--k", "4", "--flow-kib", "2048",
                              "--fail-core-link-at-us", "20"],
    # Background flows (heavy-tailed sizes, 20 % of each host's rate) beside the permutation,
    # and 10 % beside the 15:1 incast over PFC, where they are its head-of-line victims.
    "background16": ["--hosts", "16", "--hosts-per-leaf", "4", "--spines", "4", "--flow-kib",
                     "1024", "--background-load", "0.2"],
    "rocev2_incast16_pfc_background": ["--transport", "rocev2", "--hosts", "16",
                                       "--hosts-per-leaf", "4", "--spines", "4", "--workload",
                                       "incast", "--flow-kib", "1024", "--pfc",
                                       "--background-load", "0.1"],
    # One 2 B message in flight between two leaves (ib_send_lat's pattern), and the busiest
    # leaf-spine link failing 5 ms in: what the failure costs the exchanges it hits.
    "pingpong_core_failure": ["--workload", "pingpong", "--hosts", "2", "--hosts-per-leaf", "1",
                              "--spines", "4", "--exchanges", "2000",
                              "--fail-core-link-at-us", "5000"],
}
VOLATILE = {"wall_s"}


def run(sim, args):
    p = subprocess.run([sim] + args, capture_output=True, text=True, timeout=600)
    if p.returncode not in (0, 1) or not p.stdout.strip():
        sys.exit(f"{sim} {' '.join(args)}: exit {p.returncode}\n{p.stderr}")
    d = json.loads(p.stdout)
    return {k: v for k, v in d.items() if k not in VOLATILE}


def main():
    argv = sys.argv[1:]
    update = "--update" in argv
    argv = [a for a in argv if a != "--update"]
    if len(argv) < 2:
        sys.exit(__doc__)
    sim, golden = argv[0], argv[1]
    names = argv[2:] or list(SCENARIOS)
    bad = 0
    for name in names:
        args = SCENARIOS[name]
        first, second = run(sim, args), run(sim, args)
        if first != second:
            print(f"FAIL {name}: two runs of one seed differ: {first} / {second}")
            bad += 1
            continue
        path = os.path.join(golden, name + ".json")
        if update or not os.path.exists(path):
            with open(path, "w") as f:
                json.dump(first, f, indent=1, sort_keys=True)
                f.write("\n")
            print(f"wrote {path}")
            continue
        with open(path) as f:
            want = json.load(f)
        diff = [(k, want.get(k), first.get(k)) for k in sorted(set(want) | set(first))
                if want.get(k) != first.get(k)]
        if diff:
            bad += 1
            print(f"FAIL {name} ({' '.join(args)}): figures moved (old -> new):")
            for k, old, new in diff:
                print(f"  {k}: {old} -> {new}")
        else:
            if "exchanges" in first:
                print(f"ok {name}: exchange p50 {first['exchange_p50_us']} us, worst after the "
                      f"failure {first['after_failure_worst_x_p50']}x, {first['events']} events")
            else:
                print(f"ok {name}: completion {first['completion_us']} us, goodput "
                      f"{first['goodput_gbps']} Gbit/s, {first['events']} events")
    sys.exit(1 if bad else 0)


main()
