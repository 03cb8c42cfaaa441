"""``--config``: a transformers config as users keep it (a ``config.json``, a
``save_pretrained`` directory, a model id in the local Hugging Face cache),
read offline, and the dtype it asks for."""

from __future__ import annotations

import json
import os

import torch

from .errors import UsageError

DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "float64": torch.float64, "double": torch.float64, "fp64": torch.float64,
}


def config_file(spec: str) -> str:
    """The ``config.json`` a ``--config`` value names: a file, a directory holding
    one (what ``save_pretrained`` writes), or a model id whose config is in the
    local Hugging Face cache (resolved by transformers, offline).

    Example::

        >>> config_file("checkpoints/llama-1b")          # a save_pretrained directory
        'checkpoints/llama-1b/config.json'
    """
    if os.path.isdir(spec):
        path = os.path.join(spec, "config.json")
        if not os.path.isfile(path):
            raise UsageError(f"--config {spec}: the directory has no config.json (save_pretrained writes one there)")
        return path
    if os.path.exists(spec):
        return spec
    cached = _cached_config(spec)
    if cached is None:
        raise UsageError(
            f"--config {spec}: no such file or directory, nor a model id whose config.json is in the local "
            f"Hugging Face cache (nothing is downloaded; fetch it first, e.g. `hf download {spec} config.json`)"
        )
    return cached


def _cached_config(model_id: str) -> str | None:
    try:
        from transformers.utils import cached_file
    except ImportError:
        return None
    try:
        return cached_file(model_id, "config.json", local_files_only=True)
    except Exception:  # not a repo id, or not in the cache: the caller says both
        return None


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


def load_config(spec: str, fn):
    """A transformers config for ``fn`` from a ``--config`` value (see
    :func:`config_file`), built offline; returns ``(config, data)``, ``data``
    being the JSON object read.

    The class's own ``config_class`` when it has one (``LlamaForCausalLM``),
    else ``AutoConfig.for_model`` from the file's ``model_type``.

    Example::

        >>> config, data = load_config("llama-70b.json", transformers.LlamaForCausalLM)
        >>> config
        LlamaConfig {...}
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    path = config_file(spec)
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise UsageError(f"--config {spec}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"--config {spec}: {path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise UsageError(f"--config {spec}: expected a JSON object, got {type(data).__name__}")
    owner = getattr(fn, "__self__", fn)
    config_class = getattr(owner, "config_class", None)
    try:
        if config_class is not None and hasattr(config_class, "from_dict"):
            return config_class.from_dict(data), data
        if "model_type" in data:
            import transformers

            rest = dict(data)
            return transformers.AutoConfig.for_model(rest.pop("model_type"), **rest), data
    except Exception as e:
        raise UsageError(f"--config {spec}: building the config raised {type(e).__name__}: {_first_line(e)}") from e
    raise UsageError(
        f"--config {spec}: the target has no config_class and the file has no \"model_type\"; "
        "--config is for transformers models (e.g. transformers:LlamaForCausalLM)"
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "(no message)"
