"""Building what the command line names: ``TARGET`` (``module:callable`` or
``file.py:callable``), its arguments as Python literals, a transformers
config, a dtype and a device, all deferred; and the resident memory of this
process, which the command line and the demo report."""

from __future__ import annotations

import ast
import contextlib
import difflib
import importlib
import importlib.util
import inspect
import os
import re
import resource
import sys
import time

import torch

from ..session import deferred_init
from ..text import dtype_name
from .config import DTYPES, config_dtype, configured_callable, load_config, signatures
from .errors import ConstructorError, TargetError, UsageError, one_line


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
            raise TargetError(f"loading {module_name} raised {type(e).__name__}: {one_line(e)}") from e
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
            raise TargetError(f"importing {module_name!r} raised {type(e).__name__}: {one_line(e)}") from e
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
    if key not in DTYPES:
        raise UsageError(f"--dtype {text!r}: expected one of float32, bfloat16, float16, float64")
    return DTYPES[key]


def _accepts(fn, name: str) -> bool:
    for sig in signatures(fn):
        p = sig.parameters.get(name)
        if p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            return True
    return False


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


# Parameters the command line fills from its own options.
_OPTION_OF = {"device": "--device D", "dtype": "--dtype T", "config": "--config FILE|DIR|MODEL_ID"}


def check_arguments(fn, call: str, args, kwargs, *, has_config: bool = False) -> None:
    """Refuse, before building, arguments that do not fit ``fn``'s signature: too
    many positional values, a missing one (``config``: pass ``--config``), or a
    positional value that lands in ``device``/``dtype`` (``Linear 4 4 5 6``).
    Arguments that fit any of :func:`signatures` pass; a callable whose
    signature is opaque is left to the call itself.

    Example::

        >>> check_arguments(torch.nn.Linear, "torch.nn:Linear(4, 4, 5, 6)", [4, 4, 5, 6], {})
        Traceback (most recent call last):
        UsageError: torch.nn:Linear(4, 4, 5, 6): the positional value 6 lands in parameter 'device' ...
    """
    sigs = signatures(fn)
    if not sigs:
        return  # a builtin without a signature, or an opaque one: the call itself will tell
    first_error = None
    for sig in sigs:
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            first_error = first_error or (sig, str(e))
            continue
        _check_positional(fn, sig, call, bound, len(args), has_config)
        return
    sig, text = first_error
    shown = _signature_text(fn, sig)
    missing = re.search(r"missing a required argument: '(\w+)'", text)
    if missing:
        name = missing.group(1)
        if name == "config" and not has_config:
            hint = "pass a config with --config FILE|DIR|MODEL_ID"
        elif name in _OPTION_OF:
            hint = f"pass it with {_OPTION_OF[name]}"
        else:
            hint = f"give it as an ARG or with -k {name}=VALUE"
        raise UsageError(f"{call}: missing argument {name!r} of {shown}; {hint}") from None
    if "too many positional arguments" in text:
        takes = [p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        raise UsageError(
            f"{call}: too many positional values: {shown} takes at most {len(takes)}, got {len(args)}; "
            "name the others with -k name=value"
        ) from None
    raise UsageError(f"{call}: {text} (the callable is {shown})") from None


def _check_positional(fn, sig, call, bound, count, has_config) -> None:
    positional = list(bound.arguments.items())[:count]
    for i, (name, value) in enumerate(positional):
        if name in ("device", "dtype") and not (has_config and i == 0):
            raise UsageError(
                f"{call}: the positional value {value!r} lands in parameter {name!r} of {_signature_text(fn, sig)}; "
                f"pass the {name} with {_OPTION_OF[name]}, and other arguments with -k name=value"
            )


def _signature_text(fn, sig) -> str:
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, type) and getattr(fn, "__name__", None):
        name = f"{owner.__name__}.{fn.__name__}"  # the class named, not where the method was written
    else:
        name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    plain = sig.replace(
        parameters=[p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()],
        return_annotation=inspect.Signature.empty,
    )
    return f"{name}{plain}"


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
    """Build ``opts.target`` deferred; return ``(result, seconds, resident bytes grown,
    call text, dtype text)``, the last saying which default dtype it was built under
    and why.

    Example::

        >>> opts = make_parser().parse_args(["inspect", "torch.nn:Linear", "4", "2"])
        >>> model, seconds, grown, call, dtype = build(opts)
        >>> call, dtype
        ('torch.nn:Linear(4, 2)', 'float32 (PyTorch default)')
    """
    fn = load_target(opts.target)
    args = [parse_value(a) for a in opts.args]
    kwargs = parse_kwargs(opts.kwarg)
    spec = opts.target
    if opts.config:
        built_by = configured_callable(fn)
        if built_by is not fn:
            spec, fn = f"{spec}.{built_by.__name__}", built_by
    call = describe_call(spec, args, kwargs, opts.config)
    dtype = parse_dtype(opts.dtype) if opts.dtype else None
    why = "--dtype" if dtype is not None else None
    if opts.config:
        config, data = load_config(opts.config, fn)
        args = [config] + args
        if dtype is None:
            dtype, key = config_dtype(data)
            if dtype is not None:
                why = f"the config's {key}; --dtype overrides it"
        elif not isinstance(config, dict) and hasattr(config, "dtype"):
            # transformers' from_config builds under config.dtype, whatever the default dtype.
            config.dtype = dtype
    check_arguments(fn, call, args, kwargs, has_config=bool(opts.config))
    device_ctx = contextlib.nullcontext()
    if opts.device:
        try:
            device = torch.device(opts.device)
        except (RuntimeError, TypeError) as e:
            raise UsageError(f"--device {opts.device!r}: {one_line(e)}") from None
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
        raise ConstructorError(f"{call} raised {type(e).__name__}: {one_line(e)}") from e
    seconds = time.perf_counter() - t0
    used = dtype_name(dtype if dtype is not None else torch.get_default_dtype())
    dtype_text = f"{used} ({why})" if why else f"{used} (PyTorch default)"
    return result, seconds, rss_bytes() - grown_from, call, dtype_text


def peak_rss_bytes() -> int:
    """The peak resident memory of this process so far, in bytes.

    Example::

        >>> peak_rss_bytes() >= rss_bytes()
        True
    """
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def rss_bytes() -> int:
    """The resident memory of this process now (Linux; elsewhere the peak), in bytes.

    Example::

        >>> before = rss_bytes(); m = deferred_init(Llama, LLAMA_70B); rss_bytes() - before < 2**30
        True
    """
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()
