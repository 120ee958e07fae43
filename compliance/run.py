#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Runs the MetaRoCE wire compliance checks against an implementation under test (IUT).

The tester plays the IUT's peer from a raw socket on IFACE (an interface that reaches the IUT's
port, e.g. the other end of its veth), answering ARP for its own addresses (TESTER_NET.10 and up);
the IUT is driven through plain verbs by agent.py (AGENT). See compliance/README.md.
Exit status: 0 all checks pass (or fail as expected), 1 a check fails, 77 nothing could run.
"""
import argparse
import ipaddress
import os
import shlex
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checks  # noqa: E402
from tester import Agent, Counters, Fail, Port, Skip  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iface", required=True, help="the tester's interface")
    ap.add_argument("--iut-ip", required=True, help="the IUT device's IPv4 address")
    ap.add_argument("--dev", required=True, help="the IUT's verbs device name")
    ap.add_argument("--tester-ips", default=None,
                    help="first tester address (default: the IUT's + 9); each check takes new ones")
    ap.add_argument("--agent", default=f"{sys.executable} {HERE}/agent.py",
                    help="command that runs agent.py for the IUT (--dev is appended)")
    ap.add_argument("--counters", default="",
                    help="command printing the IUT's counters as JSON {\"counters\": {...}}")
    ap.add_argument("--rx-capacity", type=int, default=None,
                    help="the IUT's receive capacity in Mbit/s (0: it gives no rate hints)")
    ap.add_argument("--rto-initial-us", type=float, default=1000,
                    help="the IUT's RTO before any RTT sample (W§7 default: 1000)")
    ap.add_argument("--kernel-udp", action="store_true",
                    help="the IUT receives through the host's UDP sockets: IPv4/UDP faults are "
                         "the kernel's to drop, not counted by the IUT")
    ap.add_argument("--only", default="", help="comma-separated check names")
    ap.add_argument("--xfail", default="", help="comma-separated checks expected to fail")
    ap.add_argument("--log", default="/tmp/metaroce-compliance-agent.log")
    ap.add_argument("--list", action="store_true")
    a = ap.parse_args()
    if a.list:
        for c in checks.CHECKS:
            print(f"{c.check_name:55} {c.sections}{'  (counters)' if c.counters else ''}")
        return 0
    first = ipaddress.IPv4Address(a.tester_ips or str(ipaddress.IPv4Address(a.iut_ip) + 9))
    pool = [str(first + i) for i in range(40)]
    only = set(filter(None, a.only.split(",")))
    xfail = set(filter(None, a.xfail.split(",")))
    names = {c.check_name for c in checks.CHECKS}
    if only - names or xfail - names:
        print(f"unknown checks: {sorted((only | xfail) - names)}", file=sys.stderr)
        return 2
    try:
        port = Port(a.iface, a.iut_ip)
    except OSError as ex:
        print(f"SKIP: cannot open a raw socket on {a.iface}: {ex}")
        return 77
    port.add_ip(pool.pop(0))
    agent = None
    try:
        port.resolve()
        agent = Agent(shlex.split(a.agent) + ["--dev", a.dev], a.log)
    except Skip as ex:
        print(f"SKIP: {ex}")
        return 77
    counters = Counters(a.counters)
    results = []
    t_all = time.monotonic()
    try:
        for c in checks.CHECKS:
            if only and c.check_name not in only:
                continue
            notes = []
            ctx = checks.Ctx(port, agent, counters, pool, a.rx_capacity, notes,
                             a.rto_initial_us * 1e-6, a.kernel_udp)
            nviol = len(port.violations)
            t0 = time.monotonic()
            try:
                c(ctx)
                status, why = "PASS", ""
            except Fail as ex:
                status, why = "FAIL", str(ex)
            except Skip as ex:
                status, why = "SKIP", str(ex)
            except Exception:
                status, why = "FAIL", "tester error: " + traceback.format_exc()
            # Every frame the IUT sent meanwhile must itself conform (W§1, W§2).
            bad = port.violations[nviol:]
            if bad and status != "FAIL":
                status = "FAIL"
                why = "; ".join(f"IUT sent a non-conforming frame: {p} [{r}]" for _, p, r in bad[:3])
            if c.check_name in xfail:
                status = {"FAIL": "XFAIL", "PASS": "XPASS"}.get(status, status)
            dt = time.monotonic() - t0
            results.append((c.check_name, status))
            print(f"{status:5} {c.check_name} [{c.sections}] ({dt:.2f} s)")
            for n in notes:
                print(f"      {n}")
            if why:
                print(f"      {why}")
            sys.stdout.flush()
    finally:
        if agent:
            agent.close()
        port.close()
    counts = {s: sum(1 for _, x in results if x == s) for s in ("PASS", "FAIL", "XFAIL", "XPASS", "SKIP")}
    print(f"compliance: {counts} in {time.monotonic() - t_all:.1f} s")
    if counts["FAIL"] or counts["XPASS"]:
        return 1
    return 0 if counts["PASS"] or counts["XFAIL"] else 77


if __name__ == "__main__":
    sys.exit(main())
