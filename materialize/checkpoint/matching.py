"""Which checkpoint key goes into which tensor of a module, as ``load_state_dict`` does.

The module's keys are those of its state dict: parameters and persistent
buffers under their qualified names, a shared tensor under each of its
names, in ``state_dict`` order.  Checkpoint keys go through ``prefix`` (only
keys starting with it count, without it) and ``rename`` (a function from a
checkpoint key to a module key, or None to skip it).  A tied tensor is
loaded from each of its names the checkpoint has, in order (the last one
wins, as with ``load_state_dict``), and it is *missing* only when the
checkpoint has none of its names (``safetensors.torch.save_model`` and
transformers save a tied tensor once).  Shapes must be equal;
``load_state_dict``'s one exception, a shape-``[1]`` tensor for a 0-dim
parameter, is kept.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from deferinit.errors import CheckpointError, CheckpointMismatchError

from .hints import pre_hook_hint


class LoadResult(NamedTuple):
    """What ``load_checkpoint`` returns, like ``load_state_dict``'s ``_IncompatibleKeys``:
    the module's keys the checkpoint lacks, and the checkpoint's keys the module lacks.

    Example::

        >>> m = deferred_init(torch.nn.Linear, 2, 3)
        >>> missing, unexpected = load_checkpoint(m, {"bias": torch.zeros(3), "scale": torch.ones(1)}, strict=False)
        >>> missing, unexpected
        (['weight'], ['scale'])
    """

    missing_keys: list
    unexpected_keys: list


def module_keys(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` in ``state_dict`` order (persistent buffers only, ties under each name).

    Example::

        >>> [k for k, _ in module_keys(torch.nn.BatchNorm1d(2))]
        ['weight', 'bias', 'running_mean', 'running_var', 'num_batches_tracked']
    """
    out = []
    for prefix, sub in module.named_modules(remove_duplicate=False):
        dot = prefix + "." if prefix else ""
        for name, t in sub._parameters.items():
            if t is not None:
                out.append((dot + name, t))
        for name, t in sub._buffers.items():
            if t is not None and name not in sub._non_persistent_buffers_set:
                out.append((dot + name, t))
    return out


def match(module: torch.nn.Module, entries: dict, *, prefix: str = "", rename=None, strict: bool = True, source: str = ""):
    """``(pairs, result)``: ``(key, tensor, entry)`` to load in order, and the
    missing and unexpected keys; raises :class:`CheckpointMismatchError` on a
    shape mismatch, or on missing or unexpected keys when ``strict``."""
    mapped: dict = {}
    for key, entry in entries.items():
        if prefix:
            if not key.startswith(prefix):
                continue
            key = key[len(prefix):]
        if rename is not None:
            new = rename(key)
            if new is None:
                continue
            if not isinstance(new, str):
                raise TypeError(f"rename({key!r}) returned {type(new).__name__}; return a str, or None to skip the key")
            key = new
        if key in mapped:
            raise CheckpointError(
                f"two checkpoint keys become {key!r} ({mapped[key].key!r} and {entry.key!r}); "
                "check prefix= and rename=."
            )
        mapped[key] = entry

    keys = module_keys(module)
    names = {k for k, _ in keys}
    loaded_ids = {id(t) for k, t in keys if k in mapped}
    pairs, mismatched = [], []
    for key, tensor in keys:
        entry = mapped.get(key)
        if entry is None:
            continue
        if tuple(entry.shape) != tuple(tensor.shape):
            if tensor.dim() == 0 and tuple(entry.shape) == (1,):
                entry = entry.first()
            else:
                mismatched.append(
                    f"size mismatch for {key}: the checkpoint has {list(entry.shape)} ({entry.describe()}), "
                    f"the module {list(tensor.shape)}"
                )
                continue
        pairs.append((key, tensor, entry))
    missing = [k for k, t in keys if k not in mapped and id(t) not in loaded_ids]
    unexpected = [k for k in mapped if k not in names]
    problems = list(mismatched)
    if strict:
        if missing:
            problems.append("missing key(s): " + ", ".join(repr(k) for k in missing))
        if unexpected:
            problems.append("unexpected key(s): " + ", ".join(repr(k) for k in unexpected))
    if problems:
        hint = "" if mismatched else " Pass strict=False to load the keys that match, or prefix=/rename= to map names."
        if strict and (missing or unexpected):
            hint += pre_hook_hint(module)
        raise CheckpointMismatchError(
            f"cannot load {source or 'the checkpoint'} into {type(module).__name__}: "
            + "; ".join(problems) + f". Nothing was loaded or recorded.{hint}"
        )
    return pairs, LoadResult(missing, unexpected)
