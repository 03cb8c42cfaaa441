"""The ``deferinit`` command line (also ``python -m deferinit``).

Three commands::

    deferinit inspect TARGET [ARG ...] [-k name=value ...] [--config cfg.json]
                     [--device D] [--dtype T] [--shard N]
    deferinit graph   TARGET [ARG ...] [...] -o FILE [--module M] [--depth N] [--expand]
    deferinit demo    [--size 70b|tiny] [--seed S] [-o FILE]

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
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import difflib
import importlib
import importlib.util
import inspect
import json
import os
import re
import sys
import time

import torch

from .view import dtype_name

PROG = "deferinit"

#: Bytes per parameter to train with Adam in fp32: weights, gradients,
#: and Adam's two moment estimates (exp_avg, exp_avg_sq), 4 bytes each.
ADAM_BYTES_PER_PARAM = 16

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "float64": torch.float64, "double": torch.float64, "fp64": torch.float64,
}


class CommandError(Exception):
    """A failure the command line reports as one line on stderr (exit status ``status``)."""

    status = 1


class UsageError(CommandError):
    """Bad input on the command line: an unknown target, a malformed ``-k``, a bad option."""

    status = 2


class TargetError(UsageError):
    """``TARGET`` does not name an importable callable."""


class ConstructorError(CommandError):
    """The target callable raised while it was being built deferred."""


# -- formatting -------------------------------------------------------------------


def fmt_bytes(n: float) -> str:
    """Bytes in binary units.

    Example::

        >>> fmt_bytes(1536), fmt_bytes(141 * 2**30)
        ('1.5 KiB', '141.0 GiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def fmt_seconds(s: float) -> str:
    """Seconds, in ms below one second.

    Example::

        >>> fmt_seconds(0.0123), fmt_seconds(3.4)
        ('12.3 ms', '3.40 s')
    """
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def fmt_count(n: int) -> str:
    """A count with thousands separators and a short form.

    Example::

        >>> fmt_count(70553706496)
        '70,553,706,496 (70.55 B)'
    """
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n:,} ({n / size:.2f} {unit})"
    return f"{n:,}"


# -- the inspect table --------------------------------------------------------------


@dataclasses.dataclass
class Summary:
    """What ``deferinit inspect`` reports about a module, computed from shapes only.

    ``params``/``buffers`` map a dtype to ``[tensors, elements, bytes]``;
    ``largest`` is ``(name, class, elements, bytes)`` of the module with the
    most bytes of its own parameters.
    """

    params: dict
    buffers: dict
    largest: tuple | None
    devices: list
    deferred: int
    total: int

    @property
    def param_count(self) -> int:
        return sum(v[1] for v in self.params.values())

    @property
    def param_bytes(self) -> int:
        return sum(v[2] for v in self.params.values())

    @property
    def buffer_bytes(self) -> int:
        return sum(v[2] for v in self.buffers.values())

    @property
    def adam_bytes(self) -> int:
        """Memory to train with Adam in fp32: 16 bytes per parameter, plus the buffers."""
        return ADAM_BYTES_PER_PARAM * self.param_count + self.buffer_bytes


def summarize(module: torch.nn.Module) -> Summary:
    """Counts and bytes of a module's parameters and buffers (ties counted once), by dtype.

    Example::

        >>> s = summarize(deferred_init(torch.nn.Linear, 4096, 4096))
        >>> s.param_count, s.param_bytes
        (16781312, 67125248)
    """
    from .session import is_deferred

    def table(tensors):
        out: dict = {}
        for t in tensors:
            row = out.setdefault(t.dtype, [0, 0, 0])
            row[0] += 1
            row[1] += t.numel()
            row[2] += t.numel() * t.element_size()
        return out

    params = list(module.parameters())
    buffers = list(module.buffers())
    largest = None
    for name, sub in module.named_modules():
        own = list(sub.parameters(recurse=False))
        nbytes = sum(p.numel() * p.element_size() for p in own)
        if own and (largest is None or nbytes > largest[3]):
            largest = (name or "<root>", type(sub).__name__, sum(p.numel() for p in own), nbytes)
    everything = params + buffers
    devices = sorted({str(t.device) for t in everything})
    return Summary(
        params=table(params),
        buffers=table(buffers),
        largest=largest,
        devices=devices,
        deferred=sum(1 for t in everything if is_deferred(t)),
        total=len(everything),
    )


def format_report(s: Summary, seconds: float | None, *, title: str, shard: int | None = None, grown: int | None = None) -> str:
    """The table ``deferinit inspect`` prints.

    Example::

        >>> m = deferred_init(torch.nn.Transformer, d_model=1024, nhead=16)
        >>> print(format_report(summarize(m), 0.02, title="torch.nn:Transformer", shard=8))
    """
    lines = []
    head = f"{title}"
    if seconds is not None:
        head += f": built deferred in {fmt_seconds(seconds)}"
        if grown is not None:
            head += f", resident memory +{fmt_bytes(max(grown, 0))}"
    lines.append(head)
    lines.append("")
    rows = [("", "tensors", "elements", "bytes")]

    def section(label, table):
        tensors = sum(v[0] for v in table.values())
        numel = sum(v[1] for v in table.values())
        nbytes = sum(v[2] for v in table.values())
        rows.append((label, f"{tensors:,}", f"{numel:,}", fmt_bytes(nbytes)))
        if len(table) > 1 or (table and label == "parameters"):
            for dtype, (t, n, b) in sorted(table.items(), key=lambda kv: -kv[1][2]):
                rows.append((f"  {dtype_name(dtype)}", f"{t:,}", f"{n:,}", fmt_bytes(b)))
        return tensors, numel, nbytes

    pt, pn, pb = section("parameters", s.params)
    bt, bn, bb = section("buffers", s.buffers)
    rows.append(("total", f"{pt + bt:,}", f"{pn + bn:,}", fmt_bytes(pb + bb)))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        lines.append(
            f"  {r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]:>{widths[3]}}"
        )
    lines.append("")
    facts = []
    if s.largest is not None:
        name, cls, numel, nbytes = s.largest
        facts.append(("largest layer", f"{name} ({cls}): {numel:,} parameters, {fmt_bytes(nbytes)}"))
    facts.append(("parameters", fmt_count(s.param_count)))
    facts.append(("devices", ", ".join(s.devices) or "-"))
    facts.append(("deferred tensors", f"{s.deferred} of {s.total}"))
    facts.append((
        "train with Adam",
        f"{fmt_bytes(s.adam_bytes)} = {ADAM_BYTES_PER_PARAM} B x {s.param_count:,} parameters "
        f"(fp32 weights, gradients, exp_avg, exp_avg_sq) + {fmt_bytes(s.buffer_bytes)} buffers; "
        "activations not included",
    ))
    if shard:
        per_weights = (s.param_bytes + s.buffer_bytes) / shard
        gather = f"; gathering the largest layer takes {fmt_bytes(s.largest[3])} more" if s.largest else ""
        facts.append((
            f"sharded over {shard}",
            f"{fmt_bytes(s.adam_bytes / shard)} per device to train with Adam, "
            f"{fmt_bytes(per_weights)} per device for the weights (fully sharded, as FSDP/ZeRO-3){gather}",
        ))
    if seconds is not None:
        facts.append(("deferral took", fmt_seconds(seconds)))
    width = max(len(k) for k, _ in facts)
    for k, v in facts:
        lines.append(f"  {k:<{width}}  {v}")
    return "\n".join(lines)


# -- building the target ------------------------------------------------------------


def load_target(spec: str):
    """The callable ``spec`` names: ``module:attr.path`` or ``file.py:attr.path``.

    Example::

        >>> load_target("torch.nn:Linear")
        <class 'torch.nn.modules.linear.Linear'>
    """
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise TargetError(f"TARGET must be module:callable, like torch.nn:Transformer (got {spec!r})")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` would
    if module_name.endswith(".py"):
        if not os.path.isfile(module_name):
            raise TargetError(f"cannot load {module_name}: no such file")
        name = "_deferinit_target_" + re.sub(r"\W", "_", os.path.basename(module_name)[:-3])
        spec_ = importlib.util.spec_from_file_location(name, module_name)
        module = importlib.util.module_from_spec(spec_)
        sys.modules[name] = module
        try:
            spec_.loader.exec_module(module)
        except Exception as e:
            raise TargetError(f"loading {module_name} raised {type(e).__name__}: {_first_line(e)}") from e
    else:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            missing = e.name or module_name
            raise TargetError(
                f"cannot import module {module_name!r}: no module named {missing!r} "
                f"(is it installed in this Python, {sys.executable}?)"
            ) from e
        except Exception as e:
            raise TargetError(f"importing {module_name!r} raised {type(e).__name__}: {_first_line(e)}") from e
    obj = module
    walked = []
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            where = module_name + (":" + ".".join(walked) if walked else "")
            names = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise TargetError(f"{where} has no attribute {part!r}{hint}") from None
        walked.append(part)
    if not callable(obj):
        raise TargetError(f"{spec} is a {type(obj).__name__}, not a callable")
    return obj


def parse_value(text: str):
    """A command-line value: a Python literal, a ``torch.<dtype>``, or else a bare word as a string.

    Example::

        >>> parse_value("1024"), parse_value("(1, 2)"), parse_value("gelu"), parse_value("torch.bfloat16")
        (1024, (1, 2), 'gelu', torch.bfloat16)
    """
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        pass
    m = re.fullmatch(r"torch\.(\w+)", text)
    if m and isinstance(getattr(torch, m.group(1), None), torch.dtype):
        return getattr(torch, m.group(1))
    if re.fullmatch(r"[A-Za-z_][\w\-./:]*", text):
        near = difflib.get_close_matches(text.capitalize(), ["True", "False", "None"], n=1, cutoff=0.75)
        if near:
            # `bias=false` or `bias=Flase` as the string 'false' would be silently truthy.
            raise UsageError(f"{text!r} looks like {near[0]}; write {near[0]}, or quote it as a string: \"'{text}'\"")
        return text
    raise UsageError(
        f"cannot parse {text!r}: not a Python literal (numbers, strings, tuples, lists, dicts, "
        "True/False/None) nor a bare word; quote strings with spaces or symbols, e.g. -k name=\"'a b'\""
    )


def parse_kwargs(items) -> dict:
    """The ``-k name=value`` options as keyword arguments.

    Example::

        >>> parse_kwargs(["d_model=512", "nhead=8", "activation=gelu"])
        {'d_model': 512, 'nhead': 8, 'activation': 'gelu'}
    """
    kwargs = {}
    for item in items or ():
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep:
            raise UsageError(f"-k expects name=value, got {item!r}")
        if not name.isidentifier():
            raise UsageError(f"-k {item!r}: {name!r} is not a valid argument name")
        if name in kwargs:
            raise UsageError(f"-k {name}= given twice")
        try:
            kwargs[name] = parse_value(value)
        except UsageError as e:
            raise UsageError(f"-k {name}: {e}") from None
    return kwargs


def parse_dtype(text: str) -> torch.dtype:
    """A ``--dtype`` value.

    Example::

        >>> parse_dtype("bf16"), parse_dtype("torch.float16")
        (torch.bfloat16, torch.float16)
    """
    key = text.strip().lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise UsageError(f"--dtype {text!r}: expected one of float32, bfloat16, float16, float64")
    return _DTYPES[key]


def load_config(path: str, fn):
    """A transformers config for ``fn`` from a JSON file, built offline.

    The class's own ``config_class`` when it has one (``LlamaForCausalLM``),
    else ``AutoConfig.for_model`` from the file's ``model_type``.

    Example::

        >>> load_config("llama-70b.json", transformers.LlamaForCausalLM)
        LlamaConfig {...}
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise UsageError(f"--config {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"--config {path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: expected a JSON object, got {type(data).__name__}")
    owner = getattr(fn, "__self__", fn)
    config_class = getattr(owner, "config_class", None)
    try:
        if config_class is not None and hasattr(config_class, "from_dict"):
            return config_class.from_dict(data)
        if "model_type" in data:
            import transformers

            data = dict(data)
            return transformers.AutoConfig.for_model(data.pop("model_type"), **data)
    except Exception as e:
        raise UsageError(f"--config {path}: building the config raised {type(e).__name__}: {_first_line(e)}") from e
    raise UsageError(
        f"--config {path}: the target has no config_class and the file has no \"model_type\"; "
        "--config is for transformers models (e.g. transformers:LlamaForCausalLM)"
    )


def _accepts(fn, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    p = params.get(name)
    return p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)


@contextlib.contextmanager
def _default_dtype(dtype):
    if dtype is None:
        yield
        return
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def describe_call(spec: str, args, kwargs, config: str | None = None) -> str:
    """How a call is shown in messages.

    Example::

        >>> describe_call("torch.nn:Linear", [4, 2], {"bias": False})
        'torch.nn:Linear(4, 2, bias=False)'
    """
    parts = ([f"<config {os.path.basename(config)}>"] if config else []) + [repr(a) for a in args]
    parts += [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{spec}({', '.join(parts)})"


def build(opts):
    """Build ``opts.target`` deferred; return ``(result, seconds, resident bytes grown, call text)``.

    Example::

        >>> opts = make_parser().parse_args(["inspect", "torch.nn:Linear", "4", "2"])
        >>> model, seconds, grown, call = build(opts)
        >>> call
        'torch.nn:Linear(4, 2)'
    """
    from .demo import rss_bytes
    from .session import deferred_init

    fn = load_target(opts.target)
    args = [parse_value(a) for a in opts.args]
    kwargs = parse_kwargs(opts.kwarg)
    call = describe_call(opts.target, args, kwargs, opts.config)
    if opts.config:
        args = [load_config(opts.config, fn)] + args
    dtype = parse_dtype(opts.dtype) if opts.dtype else None
    device_ctx = contextlib.nullcontext()
    if opts.device:
        try:
            device = torch.device(opts.device)
        except (RuntimeError, TypeError) as e:
            raise UsageError(f"--device {opts.device!r}: {_first_line(e)}") from None
        if "device" in kwargs:
            raise UsageError("--device and -k device= both given; use one")
        if _accepts(fn, "device"):
            kwargs["device"] = device
        else:
            device_ctx = device  # torch.device is a context manager for factory calls
    grown_from = rss_bytes()
    t0 = time.perf_counter()
    try:
        with _default_dtype(dtype), device_ctx:
            result = deferred_init(fn, *args, **kwargs)
    except Exception as e:
        if opts.debug:
            raise
        raise ConstructorError(f"{call} raised {type(e).__name__}: {_first_line(e)}") from e
    seconds = time.perf_counter() - t0
    return result, seconds, rss_bytes() - grown_from, call


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "(no message)"


# -- commands -------------------------------------------------------------------------


def _cmd_inspect(opts, out) -> int:
    result, seconds, grown, call = build(opts)
    if not isinstance(result, torch.nn.Module):
        raise UsageError(f"{call} returned a {type(result).__name__}, not an nn.Module; inspect needs a module")
    if opts.shard is not None and opts.shard < 1:
        raise UsageError(f"--shard must be at least 1, got {opts.shard}")
    print(format_report(summarize(result), seconds, title=call, shard=opts.shard, grown=grown), file=out)
    return 0


def _cmd_graph(opts, out) -> int:
    from . import dot

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


def _cmd_demo(opts, out) -> int:
    from .demo import run_demo

    return run_demo(size=opts.size, seed=opts.seed, output=opts.output, out=out)


# -- argument parsing ------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block
        if message.startswith("the following arguments are required: TARGET"):
            message = "missing TARGET: module:callable, e.g. torch.nn:Transformer"
        self.exit(2, f"{PROG}: error: {message} (see {self.prog} --help)\n")


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
    target.add_argument("--config", metavar="JSON", help="a transformers config file; the config object is passed first")
    target.add_argument("--device", metavar="D",
                        help="device to build on (passed as device= when the callable takes it, else as torch.device(D) context); cuda works without CUDA")
    target.add_argument("--dtype", metavar="T",
                        help="default floating dtype while building (torch.set_default_dtype), e.g. bfloat16")

    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    p = sub.add_parser("inspect", parents=[common, target], help="build deferred and print parameter/memory statistics",
                       description="Build TARGET deferred and print its parameters, buffers and memory needs.")
    p.add_argument("--shard", type=int, metavar="N", help="also show per-device memory when fully sharded over N devices")
    p.set_defaults(run=_cmd_inspect)

    p = sub.add_parser("graph", parents=[common, target], help="write the graphviz view of the record",
                       description="Build TARGET deferred and draw its record (.svg, .png, .pdf need Graphviz's dot; .dot does not).")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="output file: .svg, .png, .pdf or .dot")
    p.add_argument("--module", metavar="PATH", help="draw only this submodule, e.g. layers.3")
    p.add_argument("--depth", type=int, metavar="N", help="fold modules N levels below the drawn one into boxes")
    p.add_argument("--expand", action="store_true", help="draw every repeated block instead of one marked xN")
    p.add_argument("--no-legend", action="store_true", help="leave out the legend")
    p.add_argument("--rankdir", default="LR", choices=["LR", "TB"], help="layout: left to right (default) or top to bottom")
    p.set_defaults(run=_cmd_graph)

    p = sub.add_parser("demo", parents=[common], help="defer a 70B Llama-shaped model, inspect, draw, check a block",
                       description="Build a Llama-3-70B-shaped model deferred, print its table, draw it, "
                                   "materialize one block on CPU and compare it with eager PyTorch.")
    p.add_argument("--size", choices=["70b", "tiny"], default="70b", help="model size (default 70b)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("-o", "--output", default="deferinit-demo.svg", metavar="FILE",
                   help="where to write the graph (default deferinit-demo.svg)")
    p.set_defaults(run=_cmd_demo)
    return parser


def main(argv=None) -> int:
    """Run the command line; return the exit status.

    Example::

        >>> main(["inspect", "torch.nn:Linear", "8192", "8192", "--dtype", "bfloat16"])
        0
    """
    parser = make_parser()
    opts = parser.parse_args(argv)
    opts.debug = opts.debug or opts.debug_first
    out = sys.stdout
    try:
        return opts.run(opts, out)
    except CommandError as e:
        if opts.debug:
            raise
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return e.status
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug here or in the library: still one line unless --debug
        if opts.debug:
            raise
        print(f"{PROG}: error: {type(e).__name__}: {_first_line(e)} (run with --debug for the traceback)", file=sys.stderr)
        return 1
