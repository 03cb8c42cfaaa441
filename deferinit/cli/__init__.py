"""The ``deferinit`` command line (also ``python -m deferinit``).

``inspect``, ``graph``, ``plan`` and ``demo`` (docs/cli.md; ``--help``).
``TARGET`` is ``module:callable`` (``torch.nn:Transformer``,
``transformers:LlamaForCausalLM``, ``my_models.py:build``); ``ARG`` and the
values of ``-k`` are Python literals (a bare word is a string).  The model is
built with :func:`deferinit.deferred_init`, so nothing is allocated and
nothing is downloaded.  Errors are one line on stderr (``--debug`` shows the
traceback); exit status 0 on success, 1 when the work failed (the
constructor raised, Graphviz is missing, the demo's check failed), 2 for bad
input.

Example::

    $ deferinit inspect torch.nn:Transformer -k d_model=1024 -k nhead=16 --shard 8
    $ deferinit graph torch.nn:TransformerEncoderLayer 64 4 -o layer.svg
    $ deferinit plan deferinit.demo:Llama --dtype bfloat16 --batch 1x4096 --shard 8
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from .. import dot
from ..text import fmt_seconds
from .demo import run_demo
from .errors import CommandError, ConstructorError, TargetError, UsageError, one_line
from .report import format_report, summarize
from .targets import build

PROG = "deferinit"

__all__ = ["CommandError", "ConstructorError", "TargetError", "UsageError", "main", "make_parser"]


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block
        if message.startswith("the following arguments are required: TARGET"):
            message = "missing TARGET: module:callable, e.g. torch.nn:Transformer"
        self.exit(2, f"{PROG}: error: {message} (see {self.prog} --help)\n")


def _plan(opts, out):
    # Imported when planning only: MemTracker and FlopCounterMode's imports
    # took 1.6 s of every command's start.
    from .plan import plan

    return plan(opts, out)


def _inspect(opts, out) -> int:
    if opts.shard is not None and opts.shard < 1:
        raise UsageError(f"--shard must be at least 1, got {opts.shard}")
    result, seconds, grown, call, dtype = build(opts)
    if not isinstance(result, torch.nn.Module):
        raise UsageError(f"{call} returned a {type(result).__name__}, not an nn.Module; inspect needs a module")
    print(format_report(summarize(result), seconds, title=call, shard=opts.shard, grown=grown, dtype=dtype), file=out)
    return 0


def _check_output(path: str) -> None:
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


def _graph(opts, out) -> int:
    _check_output(opts.output)
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


def _demo(opts, out) -> int:
    _check_output(opts.output)
    return run_demo(size=opts.size, seed=opts.seed, output=opts.output, out=out)


def make_parser() -> argparse.ArgumentParser:
    """The argument parser of the command line.

    Example::

        >>> make_parser().parse_args(["graph", "torch.nn:Linear", "4", "2", "-o", "x.svg"]).output
        'x.svg'
    """
    parser = _Parser(
        prog=PROG,
        description="Build PyTorch models deferred (no memory), inspect them, draw their record.",
        epilog="Run `deferinit demo` to see it on a 70B-parameter Llama-shaped model.",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show Python tracebacks on errors")
    parser.add_argument("--debug", dest="debug_first", action="store_true", help="show Python tracebacks on errors")

    target = argparse.ArgumentParser(add_help=False)
    target.add_argument("target", metavar="TARGET", help="module:callable, e.g. torch.nn:Transformer or my_model.py:build")
    target.add_argument("args", metavar="ARG", nargs="*", help="positional arguments (Python literals)")
    target.add_argument("-k", "--kwarg", action="append", metavar="NAME=VALUE",
                        help="keyword argument, value a Python literal (a bare word is a string); repeatable")
    target.add_argument("--config", metavar="C",
                        help="a model config (transformers or diffusers): a config.json, a save_pretrained directory, "
                             "or a model id in the local Hugging Face cache; passed first; its dtype is the default "
                             "unless --dtype is given")
    target.add_argument("--device", metavar="D",
                        help="device to build on (passed as device= when the callable takes it, else as torch.device(D) context); cuda works without CUDA")
    target.add_argument("--dtype", metavar="T",
                        help="default floating dtype while building (torch.set_default_dtype), e.g. bfloat16; "
                             "overrides the --config's dtype")

    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    p = sub.add_parser("inspect", parents=[common, target], help="build deferred and print parameter/memory statistics",
                       description="Build TARGET deferred and print its parameters, buffers and memory needs.")
    p.add_argument("--shard", type=int, metavar="N", help="also show per-device memory when fully sharded over N devices")
    p.set_defaults(run=_inspect)

    p = sub.add_parser("graph", parents=[common, target], help="write the graphviz view of the record",
                       description="Build TARGET deferred and draw its record (.svg, .png, .pdf need Graphviz's dot; .dot does not).")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="output file: .svg, .png, .pdf or .dot")
    p.add_argument("--module", metavar="PATH", help="draw only this submodule, e.g. layers.3")
    p.add_argument("--depth", type=int, metavar="N", help="fold modules N levels below the drawn one into boxes")
    p.add_argument("--expand", action="store_true", help="draw every repeated block instead of one marked xN")
    p.add_argument("--no-legend", action="store_true", help="leave out the legend")
    p.add_argument("--rankdir", default="LR", choices=["LR", "TB"], help="layout: left to right (default) or top to bottom")
    p.set_defaults(run=_graph)

    p = sub.add_parser("plan", parents=[common, target], help="measure one training step on fake devices (no memory)",
                       description="Build TARGET deferred and run one training step (forward, backward, optimizer "
                                   "step) on fake devices under PyTorch's MemTracker and FlopCounterMode: peak memory "
                                   "per device by category, per top-level module, and FLOPs. Nothing is allocated.")
    p.add_argument("--batch", metavar="BxS", help="token ids of BATCH x SEQUENCE (models with an nn.Embedding or config.vocab_size)")
    p.add_argument("--input", action="append", metavar="SHAPE[:DTYPE]",
                   help="a positional input, e.g. 2x3x224x224 (random, the model's dtype) or 2x16:int64; repeatable")
    p.add_argument("--shard", type=int, metavar="N", help="shard with FSDP2 over N ranks (fake process group) and show one rank")
    p.add_argument("--rank", type=int, metavar="R", help="the rank shown with --shard (default 0)")
    p.add_argument("--optimizer", default="adamw", metavar="NAME",
                   help="a torch.optim optimizer by name (adamw, adam, sgd, rmsprop...; any case) or module:Class; "
                        "default adamw (lr 1e-4; sgd: momentum 0.9)")
    p.add_argument("--optimizer-arg", action="append", metavar="NAME=VALUE",
                   help="an argument of the optimizer, a Python literal, e.g. lr=3e-4 or betas=(0.9,0.95); repeatable")
    p.add_argument("--foreach", action=argparse.BooleanOptionalAction, default=None,
                   help="the optimizer's foreach implementation (default: what PyTorch picks on the device)")
    p.add_argument("--mixed-precision", metavar="bf16|fp16",
                   help="compute in bf16 (or fp16) with float32 master weights: torch.autocast, or with --shard "
                        "FSDP2's MixedPrecisionPolicy (fp32 gradient reduction); build the model in float32")
    p.add_argument("--checkpointing", action="store_true",
                   help="activation checkpointing of each block (transformers' activation_checkpointing_enable(), "
                        "else torch's composable checkpoint on each block of every nn.ModuleList)")
    p.add_argument("--accumulate", type=int, metavar="N",
                   help="gradient accumulation: N forward/backward passes of the batch before the optimizer step")
    p.add_argument("--memory-timeline", metavar="FILE",
                   help="write the memory over the step as a picture: FILE.svg, or FILE.html (self-contained)")
    p.add_argument("--memory-snapshot", metavar="FILE",
                   help="write a memory snapshot (FILE.pickle) that PyTorch's memory visualizer opens "
                        "(https://pytorch.org/memory_viz)")
    p.set_defaults(run=_plan)

    p = sub.add_parser("demo", parents=[common], help="defer a 70B Llama-shaped model, inspect, draw, check a block",
                       description="Build a Llama-3-70B-shaped model deferred, print its table, draw it, "
                                   "materialize one block on CPU and compare it with eager PyTorch.")
    p.add_argument("--size", choices=["70b", "tiny"], default="70b", help="model size (default 70b)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("-o", "--output", default="deferinit-demo.svg", metavar="FILE",
                   help="where to write the graph (default deferinit-demo.svg)")
    p.set_defaults(run=_demo)
    return parser


def main(argv=None) -> int:
    """Run the command line; return the exit status.

    Example::

        >>> main(["inspect", "torch.nn:Linear", "8192", "8192", "--dtype", "bfloat16"])
        0
    """
    parser = make_parser()
    opts, extra = parser.parse_known_args(argv)
    if extra and hasattr(opts, "args") and all(_positional(e) for e in extra):
        opts.args += extra  # ARGs after an option (`TARGET --config C 5 7`), which argparse leaves over
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    opts.debug = opts.debug or opts.debug_first
    out = sys.stdout
    try:
        return opts.run(opts, out)
    except CommandError as e:
        if opts.debug:
            raise
        print(f"{PROG}: error: {one_line(e)}", file=sys.stderr)
        return e.status
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug here or in the library: still one line unless --debug
        if opts.debug:
            raise
        print(f"{PROG}: error: {type(e).__name__}: {one_line(e)} (run with --debug for the traceback)", file=sys.stderr)
        return 1


def _positional(word: str) -> bool:
    if not word.startswith("-"):
        return True
    try:
        float(word)  # a negative number
    except ValueError:
        return False
    return True
