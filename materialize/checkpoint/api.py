"""``load_checkpoint``: a checkpoint's tensors into a module, deferred or real."""

from __future__ import annotations

import torch

from .loading import prepare
from .matching import LoadResult, match
from .sources import open_source


def load_checkpoint(module: torch.nn.Module, source, *, strict: bool = True, prefix: str = "", rename=None) -> LoadResult:
    """Load ``source`` into ``module``'s parameters and persistent buffers, like
    ``module.load_state_dict``, and return ``(missing_keys, unexpected_keys)``.

    ``source`` is a state dict, a ``.safetensors`` file, a ``torch.save``
    file (read with ``weights_only=True``), a directory of safetensors
    files (with or without transformers' ``model.safetensors.index.json``),
    or a directory written by ``torch.distributed.checkpoint.save``.
    Names, ``strict``, dtype casting (to the tensor's dtype, as ``copy_``)
    and tied tensors follow ``load_state_dict``; a tied tensor counts as
    loaded when the checkpoint has any of its names.  ``prefix`` takes only
    the checkpoint keys starting with it, without it (``"model."``);
    ``rename(key)`` maps a checkpoint key to a module key, or to None to
    skip it.

    On **deferred** tensors nothing is read now but the headers: shapes are
    checked and the load is recorded.  ``materialize_module`` then reads
    each tensor's bytes once, straight into its memory, and runs none of
    the initialisation the checkpoint overwrites; tensors the checkpoint
    lacks keep their recorded initialisation.  A sharded tensor (FSDP2,
    tensor parallel), loaded before or after sharding, reads only the bytes
    of its shard, also from a distributed checkpoint saved on another number
    of ranks.  **Real** tensors are loaded at once.  Every check comes
    before anything is recorded or loaded: on an error, nothing changed.

    Example::

        >>> import os, tempfile
        >>> from safetensors.torch import save_file
        >>> path = os.path.join(tempfile.mkdtemp(), "linear.safetensors")
        >>> save_file({"weight": torch.ones(3, 2), "bias": torch.zeros(3)}, path)
        >>> m = deferred_init(torch.nn.Linear, 2, 3)
        >>> load_checkpoint(m, path)
        LoadResult(missing_keys=[], unexpected_keys=[])
        >>> materialize_module(m).weight.sum().item()
        6.0
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"load_checkpoint() expects an nn.Module, got {type(module).__name__}")
    entries, what = open_source(source)
    pairs, result = match(module, entries, prefix=prefix, rename=rename, strict=strict, source=what)
    for load in prepare(pairs):
        load()
    return result
