"""Helpers shared by the benchmark scripts: arguments, timing, memory readings, the results table.

Deliberately free of torch and mpify_nb imports: scripts whose functions are
started by ``torch.multiprocessing.spawn`` are re-imported in every child
(as ``__mp_main__``), and that re-import must stay cheap and start no template.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
from dataclasses import asdict, dataclass, field
from typing import Optional

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Result:
    """One measured figure, its target, and whether the target is met (None: figure for information)."""

    target_id: str  # "1", "2", ... as numbered in issue 3
    name: str
    value: float
    unit: str
    target: str = ""
    passed: Optional[bool] = None
    detail: str = ""
    extra: dict = field(default_factory=dict)


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, shorter runs (noisier figures)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH (used by run_all.py)")
    return parser.parse_args()


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def load() -> str:
    """``load 3.6/4.1/4.7``: the machine's load averages (1, 5, 15 min), for a figure's line."""
    return "load " + "/".join(f"{x:.1f}" for x in os.getloadavg())


def spread(xs: list[float]) -> str:
    """``median 0.991 (quartiles 0.962-1.013, 12 pairs)``."""
    if len(xs) < 2:
        return f"median {median(xs):.3f} ({len(xs)} pair)"
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return f"median {median(xs):.3f} (quartiles {q1:.3f}-{q3:.3f}, {len(xs)} pairs)"


def fmt_s(x: float) -> str:
    return f"{x * 1000:.1f} ms" if x < 1 else f"{x:.3f} s"


def fmt_list(xs: list[float]) -> str:
    return "[" + ", ".join(f"{x:.3f}" for x in xs) + "]"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status_kb(pid: int | str, key: str) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_mb(pid: int | str = "self") -> Optional[float]:
    """Resident memory (VmRSS) of a process in MB (2**20 bytes); None if it is gone."""
    kb = _status_kb(pid, "VmRSS")
    return None if kb is None else kb / 1024


def pss_mb(pid: int | str = "self") -> Optional[float]:
    """Proportional set size in MB: RSS with shared pages divided among their sharers.
    For a forked rank this is closer to what the rank really costs than RSS."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def count_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def count_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def print_results(title: str, results: list[Result]) -> None:
    print()
    print(f"== {title}")
    print_table(results)


def print_table(results: list[Result]) -> None:
    rows = [("#", "figure", "value", "target", "result")]
    for r in results:
        verdict = "" if r.passed is None else ("PASS" if r.passed else "FAIL")
        value = f"{r.value:.3f} {r.unit}".rstrip()
        rows.append((r.target_id, r.name, value, r.target, verdict))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for k, row in enumerate(rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if k == 0:
            print("  ".join("-" * w for w in widths))
    for r in results:
        if r.detail:
            print(f"  [{r.target_id}] {r.name}: {r.detail}")


def finish(title: str, results: list[Result], args: argparse.Namespace) -> int:
    """Print the table, write JSON if asked; exit status 1 if a target failed."""
    print_results(title, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    sys.stdout.flush()
    return 1 if any(r.passed is False for r in results) else 0


def load_results(path: str) -> list[Result]:
    with open(path) as f:
        return [Result(**d) for d in json.load(f)]


def machine_line() -> str:
    """One line on the conditions of the run: cores, load (other work on the machine skews figures)."""
    try:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "?"
    return f"cpus={os.cpu_count()} loadavg={load} python={sys.version.split()[0]}"
