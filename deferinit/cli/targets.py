"""Building what the command line names: ``TARGET`` (``module:callable`` or
``file.py:callable``), its arguments as Python literals, a transformers
config, a dtype and a device, all deferred."""

from __future__ import annotations

import ast
import contextlib
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

from ..session import deferred_init
from .errors import ConstructorError, TargetError, UsageError
from .resources import rss_bytes

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "float64": torch.float64, "double": torch.float64, "fp64": torch.float64,
}


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
            raise TargetError(f"loading {module_name} raised {type(e).__name__}: {first_line(e)}") from e
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
            raise TargetError(f"importing {module_name!r} raised {type(e).__name__}: {first_line(e)}") from e
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
        raise UsageError(f"--config {path}: building the config raised {type(e).__name__}: {first_line(e)}") from e
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
            raise UsageError(f"--device {opts.device!r}: {first_line(e)}") from None
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
        raise ConstructorError(f"{call} raised {type(e).__name__}: {first_line(e)}") from e
    seconds = time.perf_counter() - t0
    return result, seconds, rss_bytes() - grown_from, call


def first_line(e: BaseException) -> str:
    """The first line of an exception's message, for one-line errors.

    Example::

        >>> first_line(ValueError("bad value\\nmore detail"))
        'bad value'
    """
    text = str(e).strip()
    return text.splitlines()[0] if text else "(no message)"
