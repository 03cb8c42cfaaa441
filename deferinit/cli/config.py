"""``--config``: a model config as users keep it (a ``config.json``, a
``save_pretrained`` directory, a model id in the local Hugging Face cache),
read offline by the target's own library, and the dtype it asks for.

transformers targets get a config object (``LlamaConfig``), diffusers targets
(``ConfigMixin`` classes: models, schedulers) the dict their ``load_config``
returns, and a diffusers class is built with its ``from_config``, the way
diffusers builds one from a config.  Whether a target takes a config is read
from its signatures, seen through the wrappers libraries put around it."""

from __future__ import annotations

import inspect
import json
import os

import torch

from .errors import UsageError, one_line

DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "float64": torch.float64, "double": torch.float64, "fp64": torch.float64,
}

# First-parameter names that say a plain function takes a config.
_CONFIG_NAMES = ("config", "cfg", "conf")


def config_file(spec: str, name: str = "config.json") -> str:
    """The config file a ``--config`` value names: a file, a directory holding
    ``name`` (what ``save_pretrained`` writes), or a model id whose ``name`` is
    in the local Hugging Face cache (looked up offline).

    Example::

        >>> config_file("checkpoints/llama-1b")          # a save_pretrained directory
        'checkpoints/llama-1b/config.json'
    """
    if os.path.isdir(spec):
        path = os.path.join(spec, name)
        if not os.path.isfile(path):
            raise UsageError(f"--config {spec}: the directory has no {name} (save_pretrained writes one there)")
        return path
    if os.path.exists(spec):
        return spec
    cached = _cached_config(spec, name)
    if cached is None:
        raise UsageError(
            f"--config {spec}: no such file or directory, nor a model id whose {name} is in the local "
            f"Hugging Face cache (nothing is downloaded; fetch it first, e.g. `hf download {spec} {name}`)"
        )
    return cached


def _cached_config(model_id: str, name: str) -> str | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        path = try_to_load_from_cache(model_id, name)
    except Exception:  # not a repo id: the caller says so
        return None
    return path if isinstance(path, str) else None


def config_dtype(data: dict) -> tuple[torch.dtype | None, str | None]:
    """The dtype a transformers config asks for (``dtype``, or ``torch_dtype`` in
    older files) and the key it came from; ``(None, None)`` when it names none.

    Example::

        >>> config_dtype({"torch_dtype": "bfloat16"}), config_dtype({"dtype": "auto"})
        ((torch.bfloat16, 'torch_dtype'), (None, None))
    """
    for key in ("dtype", "torch_dtype"):
        value = data.get(key)
        if isinstance(value, str) and value.lower().removeprefix("torch.") in DTYPES:
            return DTYPES[value.lower().removeprefix("torch.")], key
    return None, None


def owner_class(fn):
    """The class ``fn`` belongs to: ``fn`` itself when it is a class, the class of
    a classmethod (``AutoModelForCausalLM.from_config``), else None.

    Example::

        >>> owner_class(transformers.AutoModelForCausalLM.from_config).__name__
        'AutoModelForCausalLM'
    """
    if isinstance(fn, type):
        return fn
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, type) else None


def is_diffusers_config_class(cls) -> bool:
    """Whether ``cls`` reads its configs as diffusers' ``ConfigMixin`` does: a
    ``load_config`` classmethod and the ``config_name`` of its file."""
    return (
        cls is not None and callable(getattr(cls, "load_config", None))
        and callable(getattr(cls, "from_config", None)) and isinstance(getattr(cls, "config_name", None), str)
    )


def configured_callable(fn):
    """What to call with a config: a diffusers ``ConfigMixin`` class is built by its
    ``from_config`` (its constructor takes the config's entries, not a config);
    anything else is called as named.

    Example::

        >>> configured_callable(diffusers.UNet2DConditionModel).__name__
        'from_config'
    """
    if isinstance(fn, type) and is_diffusers_config_class(fn):
        return fn.from_config
    return fn


def load_config(spec: str, fn):
    """The config ``fn`` takes, from a ``--config`` value (see :func:`config_file`),
    read offline; returns ``(config, data)``, ``data`` being the JSON object read.

    - diffusers (``fn``'s class has ``load_config``): its ``load_config`` dict;
    - a transformers class with a ``config_class`` (``LlamaForCausalLM``):
      ``config_class.from_dict``;
    - anything else: ``AutoConfig.for_model`` from the file's ``model_type``
      (``AutoModelForCausalLM.from_config``, a function of yours); a file
      without ``model_type`` is passed as the dict it holds to a callable whose
      first parameter is named ``config``/``cfg``/``conf``, or whose signature
      says nothing (``(*args, **kwargs)``).

    Example::

        >>> config, data = load_config("llama-70b.json", transformers.LlamaForCausalLM)
        >>> config
        LlamaConfig {...}
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    owner = owner_class(fn)
    diffusers_owner = is_diffusers_config_class(owner)
    path = config_file(spec, owner.config_name if diffusers_owner else "config.json")
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise UsageError(f"--config {spec}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"--config {spec}: {path} is not valid JSON ({one_line(e)})") from None
    except RecursionError:
        raise UsageError(f"--config {spec}: {path} nests too deeply to read") from None
    if not isinstance(data, dict):
        raise UsageError(f"--config {spec}: expected a JSON object, got {type(data).__name__}")
    config_class = getattr(owner, "config_class", None)
    try:
        if diffusers_owner:
            return dict(owner.load_config(path)), data
        if config_class is not None and hasattr(config_class, "from_dict"):
            return config_class.from_dict(data), data
        if "model_type" in data:
            import transformers

            rest = dict(data)
            return transformers.AutoConfig.for_model(rest.pop("model_type"), **rest), data
    except Exception as e:
        raise UsageError(f"--config {spec}: building the config raised {type(e).__name__}: {one_line(e)}") from e
    if not signatures(fn) or first_parameter(fn) in _CONFIG_NAMES:  # opaque (*args, **kwargs): try it first
        return data, data
    raise UsageError(
        f"--config {spec}: cannot tell which config {getattr(fn, '__qualname__', fn)} takes: it is not a "
        "transformers or diffusers class, the file has no \"model_type\" (transformers), and its first "
        "parameter is not named config, cfg or conf; --config is for model classes and factories taking a config "
        "(transformers:LlamaForCausalLM, transformers:AutoModelForCausalLM.from_config, "
        "diffusers:UNet2DConditionModel)"
    )


def signatures(fn) -> list:
    """The signatures worth checking arguments against: the one of the function
    ``fn`` wraps (``functools.wraps``), then ``fn``'s own, leaving out opaque
    ones (``(*args, **kwargs)``, ``(**kwargs)``) that say nothing of what it takes.

    A wrapper may point ``__wrapped__`` at a bound method, whose signature has
    lost its first parameter once already (transformers' Auto classes'
    ``from_config`` then reads as ``(**kwargs)``); ``fn``'s own signature,
    ``(config, **kwargs)``, is the true one there.

    Example::

        >>> [str(s) for s in signatures(transformers.AutoModelForCausalLM.from_config)]
        ['(config, **kwargs)']
    """
    found = []
    for follow in (True, False):
        try:
            sig = inspect.signature(fn, follow_wrapped=follow)
        except (TypeError, ValueError):
            continue
        params = sig.parameters.values()
        opaque = params and all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)
        if not opaque and sig not in found:  # a callable taking nothing is still worth checking
            found.append(sig)
    return found


def first_parameter(fn) -> str | None:
    """The name of the first positional parameter ``fn`` takes, by its first
    :func:`signatures`; None when it takes none or says nothing (opaque).

    Example::

        >>> first_parameter(torch.nn.Linear), first_parameter(lambda *args, **kwargs: None)
        ('in_features', None)
    """
    for sig in signatures(fn)[:1]:
        for p in sig.parameters.values():
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                return p.name
    return None
