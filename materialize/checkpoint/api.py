"""``load_checkpoint``: a checkpoint's tensors into a module, deferred or real."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from deferinit.exclusive import exclusive
from deferinit.fake.guard import Entry, restoring
from deferinit.fake.locking import locked

from .errors import CheckpointError
from .capture import Capture, StandIns, Targets, leaked, walk
from .loading import Loader
from .matching import LoadResult, map_keys, map_metadata, result_of
from .sources import open_source
from .undo import ModuleState


def load_checkpoint(module: torch.nn.Module, source, *, strict: bool = True, prefix: str = "", rename=None) -> LoadResult:
    """Load ``source`` into ``module``'s parameters and persistent buffers, like
    ``module.load_state_dict``, and return ``(missing_keys, unexpected_keys)``.

    ``source`` is a state dict, a ``.safetensors`` file, a ``torch.save``
    file (read with ``weights_only=True``), a directory of safetensors
    files (with or without transformers' ``model.safetensors.index.json``),
    or a directory written by ``torch.distributed.checkpoint.save``.
    It runs the module's own ``load_state_dict`` on stand-ins for the
    checkpoint's tensors (:mod:`deferinit.materialize.checkpoint.capture`), so names,
    ``strict``, shapes, dtype casting (to the tensor's dtype, as ``copy_``),
    ``_load_from_state_dict`` overrides, load hooks and lazy modules are
    ``load_state_dict``'s; a tied tensor counts as loaded when the checkpoint
    has any of its names.  ``prefix`` takes only the checkpoint keys starting
    with it, without it (``"model."``); ``rename(key)`` maps a checkpoint key
    to a module key, or to None to skip it.  When a common prefix explains
    the keys that do not fit, the error says which argument to pass.

    On **deferred** tensors nothing is read now but the headers: shapes are
    checked and the load is recorded.  ``materialize_module`` then reads
    each tensor's bytes once, straight into its memory, and runs none of
    the initialisation the checkpoint overwrites; tensors the checkpoint
    lacks keep their recorded initialisation.  A sharded tensor (FSDP2,
    tensor parallel), loaded before or after sharding, reads only the bytes
    of its shard, also from a distributed checkpoint saved on another number
    of ranks.  A state dict behaves as if copied at the call.  **Real**
    tensors are loaded within the call, all or nothing: every read succeeds
    before anything is written.  An inference tensor is refused outside
    ``torch.inference_mode()``, as ``load_state_dict`` refuses it.  On an
    error, no tensor of the module changed.  A call while another thread
    materializes the module waits for it, then loads into what is real.

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
    # Deferred or real is decided once no other thread is materializing.
    return locked(exclusive(), _guarded_load, module, source, strict=strict, prefix=prefix, rename=rename)


def _guarded_load(module, source, **options) -> LoadResult:
    # An interrupted call leaves the thread as it found it (deferinit.fake.guard).
    return restoring(Entry(), _load, module, source, **options)


def _load(module, source, *, strict, prefix, rename) -> LoadResult:
    entries, what = open_source(source)
    mapped = map_keys(entries, prefix=prefix, rename=rename)
    metadata = map_metadata(getattr(source, "_metadata", None) if isinstance(source, Mapping) else None, prefix=prefix, rename=rename)
    standins = StandIns()
    state_dict = {key: standins.make(entry) for key, entry in mapped.items()}
    loader = Loader()
    state = ModuleState(module)
    try:
        missing, unexpected, errors = walk(module, state_dict, metadata, Capture(standins, Targets(module), loader))
        loader.need()
        name = leaked(module, standins)
        if name is not None:
            raise CheckpointError(
                f"cannot load {name}: a load hook of {type(module).__name__} put the checkpoint's tensor itself "
                "into the module instead of copying it, and load_checkpoint reads files lazily: it has no tensor "
                "to hand out. Pass the file's state dict instead (safetensors.torch.load_file(path)). Nothing "
                "was loaded or recorded."
            )
        result = result_of(
            module, missing, unexpected, errors, strict=strict, source=what, mapped=mapped, prefix=prefix, keys=list(entries)
        )
        loader.finish()
    except BaseException:
        if loader.committing is not None:
            loader.roll_forward()  # interrupted while writing: entirely done
        else:
            loader.undo()
            state.restore()
        raise
    return result
