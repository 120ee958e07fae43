#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Fault injection for failover.sh, through `metaroce fabric set`.

  failover_fault.py METAROCE FABRIC down busiest-core|plane1 STATE_FILE
      Waits until this run's traffic has started (200 frames through the edge), then takes
      down the core link that carried the most frames over the next 100 ms (so that the running connection
      really has paths on it), or every link of plane 1. Records what it did in STATE_FILE.
  failover_fault.py METAROCE FABRIC check STATE_FILE
      Brings the link(s) back up; exits 1 unless frames were lost on them while down (else the
      run never met the failure).
"""
import json
import subprocess
import sys
import time


def links(m, fab):
    out = subprocess.run([m, "fabric", "stat", fab, "--json"], check=True, capture_output=True,
                         text=True).stdout
    return {l["name"]: l for l in json.loads(out)["links"]}


def lost(ls, name):
    return sum(l["drop_down"] for n, l in ls.items() if n == name or
               (name.endswith(".") and n.startswith(name)))


def edge_frames(m, fab):
    return sum(l["frames_out"] for l in links(m, fab).values() if l["kind"] == "edge")


def down(m, fab, what, state):
    # Counters are cumulative over the fabric's life: wait for this run's own traffic.
    start = edge_frames(m, fab)
    deadline = time.monotonic() + 60
    while edge_frames(m, fab) - start < 200:
        if time.monotonic() > deadline:
            sys.exit("no traffic through the fabric within 60 s")
        time.sleep(0.02)
    if what == "plane1":
        name, where = "p1.", ["--plane", "1"]
    else:
        a = links(m, fab)
        time.sleep(0.1)
        b = links(m, fab)
        name = max((n for n in b if b[n]["kind"] == "core"),
                   key=lambda n: b[n]["frames_out"] - a[n]["frames_out"])
        plane, link = name.split(".")
        where = ["--plane", plane[1:], "--link", link]
    before = lost(links(m, fab), name)
    subprocess.run([m, "fabric", "set", fab] + where + ["down"], check=True, capture_output=True)
    with open(state, "w") as f:
        json.dump({"name": name, "before": before, "where": where}, f)
    print("down:", name, flush=True)


def check(m, fab, state):
    with open(state) as f:
        d = json.load(f)
    n = lost(links(m, fab), d["name"]) - d["before"]
    subprocess.run([m, "fabric", "set", fab] + d["where"] + ["up"], check=True,
                   capture_output=True)
    print(f"{d['name']} ({n} frames lost there)")
    sys.exit(0 if n > 0 else 1)


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[3] == "down":
        down(sys.argv[1], sys.argv[2], sys.argv[4], sys.argv[5])
    elif len(sys.argv) == 5 and sys.argv[3] == "check":
        check(sys.argv[1], sys.argv[2], sys.argv[4])
    else:
        sys.exit(__doc__)
