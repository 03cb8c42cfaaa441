"""Shared helpers for the benchmark scripts: timing, memory, tables, subprocesses.

Benchmarks print side-by-side figures and ratios in one run; they are not
tests (no assertion on time: machines are shared and noisy).
"""

from __future__ import annotations

import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def rss_bytes() -> int:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far.

    ``VmHWM`` from ``/proc/self/status``: ``ru_maxrss`` of a child started by
    fork and exec can carry the parent's peak (a parent that saved a 700 MB
    checkpoint would inflate every child's figure).
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def timed(fn, repeat: int = 5, warmup: int = 1):
    """``(best seconds, median seconds, last result)`` of ``fn()`` called ``repeat`` times after a warm-up."""
    result = None
    for _ in range(warmup):
        result = fn()
        del result
    times = []
    for _ in range(repeat):
        gc.collect()
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
        if _ != repeat - 1:
            del result
    return min(times), statistics.median(times), result


def timed_together(fns: dict, repeat: int = 9, warmup: int = 1) -> dict:
    """``{name: (best seconds, median seconds, last result)}``, the functions called
    in turn, ``repeat`` rounds after a warm-up: on a shared machine a slow
    spell then slows every column alike instead of one."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    results = {}
    for _ in range(repeat):
        for name, fn in fns.items():
            results.pop(name, None)
            gc.collect()
            start = time.perf_counter()
            result = fn()
            times[name].append(time.perf_counter() - start)
            results[name] = result
            del result
    return {name: (min(t), statistics.median(t), results[name]) for name, t in times.items()}


def table(headers, rows) -> str:
    """A GitHub-flavoured markdown table."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells)])


def machine() -> str:
    import torch

    cpus = os.cpu_count()
    return f"{platform.processor() or platform.machine()}, {cpus} CPUs, Python {platform.python_version()}, torch {torch.__version__}"


def run_child(script: str, *args: str, timeout: float = 1800) -> dict:
    """Run ``script`` in a fresh interpreter; it prints one JSON object as its last line."""
    out = subprocess.run(
        [sys.executable, script, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1"},
    )
    if out.returncode != 0:
        raise RuntimeError(f"{script} {' '.join(args)} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"
