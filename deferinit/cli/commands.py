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
    result, seconds, grown, call = build(opts)
    if not isinstance(result, torch.nn.Module):
        raise UsageError(f"{call} returned a {type(result).__name__}, not an nn.Module; inspect needs a module")
    if opts.shard is not None and opts.shard < 1:
        raise UsageError(f"--shard must be at least 1, got {opts.shard}")
    print(format_report(summarize(result), seconds, title=call, shard=opts.shard, grown=grown), file=out)
    return 0


def graph(opts, out) -> int:
    fmt = os.path.splitext(opts.output)[1].lower().lstrip(".")
    if fmt not in dot.FORMATS:
        raise UsageError(
            f"-o {opts.output}: the extension must be one of " + ", ".join("." + f for f in dot.FORMATS)
        )
    if opts.depth is not None and opts.depth < 0:
        raise UsageError(f"--depth must be at least 0, got {opts.depth}")
    result, seconds, _, call = build(opts)
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
    return run_demo(size=opts.size, seed=opts.seed, output=opts.output, out=out)
