#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Checks the skips of a verbose pyverbs run against docs/conformance.md.

usage: pyverbs_skips.py LOG CONFORMANCE_MD

Prints, per module, the tests run, skipped and failed, then every skip by (module, reason).
The allowed skips are the rows of the table under "## Allowed skips" in CONFORMANCE_MD:

    | module | skips | reason printed | kind | why |

A skip whose (module, reason) has no row, or more skips than its row allows, fails; so does a
row that allows more than were seen, unless its kind is "environment" (what the host has, such
as a DRM render node, may differ), so that the table stays true. Exit status 0 when it matches.
"""
import collections
import re
import sys

RESULT = re.compile(r"\.\.\. (ok|skipped|FAIL|ERROR|expected failure|unexpected success)"
                    r"(?: (['\"])(.*)\2)?\s*$")
HEADER = re.compile(r"^(\w+) \((?:tests\.)?(\w+)\.[\w.]+\)")


def parse_log(path):
    """[(module, test, outcome, reason)] of a `run_tests.py -v` log (unittest's verbose form:
    the result may follow the test's line, its docstring, or what the test printed)."""
    results = []
    module = test = None
    for line in open(path, encoding="utf-8", errors="replace"):
        m = HEADER.match(line)
        if m:
            test, module = m.group(1), m.group(2)
        r = RESULT.search(line)
        if not r and module and line.strip() in ("ok", "FAIL", "ERROR"):
            r = re.match(r"(ok|FAIL|ERROR)", line.strip())
        if r and module:
            reason = r.group(3) if r.lastindex and r.lastindex >= 3 else None
            results.append((module, test, r.group(1), reason or ""))
            module = test = None
    return results


def parse_allowed(path):
    """{(module, reason): (count, kind)} from the "## Allowed skips" table."""
    allowed = {}
    in_section = False
    for line in open(path, encoding="utf-8"):
        if line.startswith("## "):
            in_section = line.strip() == "## Allowed skips"
            continue
        if not in_section or not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 5 or cells[0] in ("module", "") or set(cells[0]) <= set("-: "):
            continue
        module, count, reason, kind = cells[0].strip("`"), cells[1], cells[2], cells[3]
        reason = reason.strip("`")
        allowed[(module, reason)] = (int(count), kind)
    return allowed


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    results = parse_log(sys.argv[1])
    allowed = parse_allowed(sys.argv[2])
    if not results:
        print("pyverbs_skips: no test results in the log", file=sys.stderr)
        return 1
    per_module = collections.OrderedDict()
    skips = collections.Counter()
    for module, _, outcome, reason in results:
        run, skipped, failed = per_module.get(module, (0, 0, 0))
        per_module[module] = (run + 1, skipped + (outcome == "skipped"),
                              failed + (outcome not in ("ok", "skipped", "expected failure")))
        if outcome == "skipped":
            skips[(module, reason)] += 1
    print("module                    tests  skipped  failed")
    for module, (run, skipped, failed) in sorted(per_module.items()):
        print(f"{module:24s} {run:6d} {skipped:8d} {failed:7d}")
    total = [sum(v[i] for v in per_module.values()) for i in range(3)]
    print(f"{'total':24s} {total[0]:6d} {total[1]:8d} {total[2]:7d}")
    bad = []
    for (module, reason), n in sorted(skips.items()):
        limit, kind = allowed.get((module, reason), (0, None))
        mark = "" if n <= limit else "  <-- not in docs/conformance.md" if kind is None \
            else f"  <-- {limit} allowed"
        print(f"  {n:3d} {module}: {reason}{mark}")
        if n > limit:
            bad.append(f"{module}: {n} x '{reason}' (allowed {limit})")
    for (module, reason), (limit, kind) in sorted(allowed.items()):
        n = skips.get((module, reason), 0)
        if n < limit and kind != "environment":
            bad.append(f"{module}: '{reason}' allowed {limit} times but seen {n}: "
                       "update docs/conformance.md")
    for b in bad:
        print(f"pyverbs_skips: {b}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
