#!/usr/bin/env python3
"""Print benchmark groups from a pytest-benchmark JSON as ratios against each group's baseline.

Each benchmark sets ``extra_info["role"]``: "baseline" for the reference (raw pyzmq, pickle,
in-process engine, ...), "treadle" for ours, or another label. For every group this prints the
median time of each role and ``speed vs baseline = baseline median / role median`` (> 1: faster),
plus throughput when ``extra_info`` has ``bytes`` or ``requests`` per round.
Usage: python tools/bench/report.py .cache/bench.json [--markdown]
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def rows(path: str) -> list[tuple[str, str, float, float | None, str]]:
    with open(path) as fh:
        data = json.load(fh)
    groups: dict[str, list[dict]] = defaultdict(list)
    for b in data["benchmarks"]:
        groups[b.get("group") or b["name"]].append(b)
    out = []
    for group, benches in groups.items():
        base = next((b for b in benches if b["extra_info"].get("role") == "baseline"), None)
        for b in benches:
            med = b["stats"]["median"]
            ratio = base["stats"]["median"] / med if base else None
            info = b["extra_info"]
            thr = ""
            if "bytes" in info:
                thr = f"{info['bytes'] / med / 2**30:.2f} GiB/s"
            elif "requests" in info:
                thr = f"{info['requests'] / med:,.0f} req/s"
            out.append((group, info.get("role", b["name"]), med, ratio, thr))
    return out


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    md = "--markdown" in sys.argv
    if md:
        print("| group | role | median | vs baseline | throughput |\n|---|---|---|---|---|")
    for group, role, med, ratio, thr in rows(sys.argv[1]):
        r = f"{ratio:.2f}x" if ratio is not None else "-"
        if md:
            print(f"| {group} | {role} | {med * 1e3:.3f} ms | {r} | {thr} |")
        else:
            print(f"{group:<60.60} {role:<14} median {med * 1e3:10.3f} ms  {r:>7} of baseline speed  {thr}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
