#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""dashboard_check.py DASHBOARD_JSON EXPORT_TEXT

Every metric a query of the Grafana dashboard (dist/grafana/metaroce.json) names, in its panels
and its variables, must be one `metaroce export` emits (a `# TYPE` line of EXPORT_TEXT, the
exporter's output on a live engine); every panel but a row must have a query. Prints what it
checked; exits 1 naming each metric the exporter does not emit.
"""
import json
import re
import sys

METRIC = re.compile(r"\bmetaroce_[a-z0-9_]+")


def queries(dash):
    for p in dash["panels"]:
        if p["type"] == "row":
            continue
        if not p.get("targets"):
            yield p["title"], None
        for t in p.get("targets", []):
            yield p["title"], t["expr"]
    for v in dash.get("templating", {}).get("list", []):
        q = v.get("query")
        if isinstance(q, dict):
            yield "variable " + v["name"], q.get("query", "")


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    dash = json.load(open(sys.argv[1]))
    emitted = set(re.findall(r"^# TYPE (\S+) ", open(sys.argv[2]).read(), re.M))
    if not emitted:
        sys.exit(f"{sys.argv[2]}: no metric families (is it `metaroce export` output?)")
    bad, names = [], set()
    for where, expr in queries(dash):
        if expr is None:
            bad.append(f"{where}: no query")
            continue
        found = METRIC.findall(expr)
        if not found:
            bad.append(f"{where}: names no metaroce metric: {expr}")
        for m in found:
            names.add(m)
            if m not in emitted:
                bad.append(f"{where}: {m} is not emitted by metaroce export")
    if bad:
        sys.exit("\n".join(bad))
    print(f"dashboard_check: {len(names)} metrics in {sum(1 for _ in queries(dash))} queries, "
          f"all emitted ({len(emitted)} families exported)")


if __name__ == "__main__":
    main()
