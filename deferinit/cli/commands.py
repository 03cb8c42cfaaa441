"""The commands: ``inspect``, ``graph`` and ``demo``; each takes the parsed
options and the output stream and returns the exit status."""

from __future__ import annotations

import os
import time

import torch

from .. import dot
from ..text import fmt_seconds
from .demo import run_demo
from .errors import CommandError, UsageError
from .report import format_report, summarize
from .targets import build


def inspect(opts, out) -> int:
    if opts.shard is not None and opts.shard < 1:
        raise UsageError(f"--shard must be at least 1, got {opts.shard}")
    result, seconds, grown, call, dtype = build(opts)
    if not isinstance(result, torch.nn.Module):
        raise UsageError(f"{call} returned a {type(result).__name__}, not an nn.Module; inspect needs a module")
    print(format_report(summarize(result), seconds, title=call, shard=opts.shard, grown=grown, dtype=dtype), file=out)
    return 0


def check_output(path: str) -> None:
    """Refuse an ``-o`` path that could not be written, before any work is done."""
    fmt = os.path.splitext(path)[1].lower().lstrip(".")
    if fmt not in dot.FORMATS:
        raise UsageError(f"-o {path}: the extension must be one of " + ", ".join("." + f for f in dot.FORMATS))
    if os.path.isdir(path):
        raise UsageError(f"-o {path}: is a directory; give a file name, e.g. {os.path.join(path, 'graph.' + fmt)}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"-o {path}: the directory {folder} does not exist; create it first or write elsewhere")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"-o {path}: cannot write in {folder} (permission denied)")


def graph(opts, out) -> int:
    check_output(opts.output)
    if opts.depth is not None and opts.depth < 0:
        raise UsageError(f"--depth must be at least 0, got {opts.depth}")
    result, seconds, _, call, _ = build(opts)
    if not isinstance(result, (torch.nn.Module, torch.Tensor)):
        raise UsageError(f"{call} returned a {type(result).__name__}; graph needs a module or a tensor")
    t0 = time.perf_counter()
    try:
        graph = dot.to_dot(
            result, module=opts.module, depth=opts.depth, expand=opts.expand,
            legend=not opts.no_legend, rankdir=opts.rankdir,
        )
    except dot.GraphViewError as e:
        raise UsageError(str(e)) from e
    try:
        path = dot.write(graph, opts.output)
    except dot.GraphvizNotFoundError as e:
        raise CommandError(str(e)) from e
    except OSError as e:
        raise CommandError(f"cannot write {opts.output}: {e.strerror or e}") from e
    print(f"wrote {path} ({call} built deferred in {fmt_seconds(seconds)}, drawn in "
          f"{fmt_seconds(time.perf_counter() - t0)})", file=out)
    return 0


def demo(opts, out) -> int:
    check_output(opts.output)
    return run_demo(size=opts.size, seed=opts.seed, output=opts.output, out=out)
