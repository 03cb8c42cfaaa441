"""What ``load_checkpoint`` accepts as a source, opened into ``key -> Entry``.

* a state dict (a mapping of names to tensors; nested dicts are flattened
  with dots; values that are not tensors are ignored);
* a ``.safetensors`` file;
* a ``torch.save`` file (what ``torch.load(weights_only=True)`` reads, in
  the zip format of PyTorch 1.6 and later; the legacy format is refused:
  re-save it);
* a directory written by ``torch.distributed.checkpoint.save`` (a
  ``.metadata`` file and ``.distcp`` files; see :mod:`.dcp`);
* another directory: transformers' ``model.safetensors.index.json`` (or
  ``pytorch_model.bin.index.json``) says which file holds which key;
  without one, every ``*.safetensors`` file in it (or else every ``*.bin``,
  ``*.pt``, ``*.pth`` file).  Only files inside the directory are read
  (:mod:`.index`).

A path that does not exist raises :class:`CheckpointNotFoundError`, also a
``FileNotFoundError``.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping

import torch

from deferinit.fake import is_fake

from .errors import CheckpointError, CheckpointNotFoundError
from .dcp import is_dcp_directory, open_dcp
from .entries import Entry, MemorySource
from .files import SafetensorsFile, TorchFile, is_torch_zip, open_regular
from .index import inside, read_index
from .nested import flatten_tensors

INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# How a legacy torch.save file begins: its magic number, pickled (protocol 2).
_LEGACY = b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19."


class DeferredValue:
    """A state dict value that is itself deferred: loaded by a recorded ``copy_``."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def describe(self) -> str:
        return "the state dict"


def open_source(source) -> tuple[dict, str]:
    """``(entries, description)`` of a checkpoint source.

    Example::

        >>> entries, what = open_source({"w": torch.ones(2, 3)})
        >>> entries["w"].shape, what
        ((2, 3), 'the state dict')
    """
    if isinstance(source, Mapping):
        return _state_dict(source), "the state dict"
    try:
        path = os.fsdecode(os.fspath(source))
    except TypeError:
        raise TypeError(
            "load_checkpoint() expects a state dict, or the path of a .safetensors file, a torch.save "
            f"file or a directory of them; got {type(source).__name__}"
        ) from None
    if os.path.isdir(path):
        if is_dcp_directory(path):
            return open_dcp(path), path
        return _directory(path), path
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"no checkpoint at {os.path.abspath(path)}: no such file or directory.", os.path.abspath(path))
    return open_file(path), os.path.abspath(path)


def open_file(path: str) -> dict:
    """``key -> Entry`` of the file at ``path``: a safetensors file, or a
    ``torch.save`` zip archive; headers only."""
    folder = os.path.dirname(os.path.abspath(path))
    if path.endswith(".distcp") or os.path.basename(path) == ".metadata" or is_dcp_directory(folder):
        raise CheckpointError(
            f"{os.path.abspath(path)} is a file of the distributed checkpoint {folder}, which holds its tensors "
            "in pieces that its .metadata file describes: pass its directory."
        )
    if path.endswith(".safetensors"):
        return SafetensorsFile(path).open()
    if is_torch_zip(path):
        return TorchFile(path).open()
    try:
        return SafetensorsFile(path).open()
    except CheckpointNotFoundError:
        raise
    except CheckpointError as e:
        reason = str(e).replace(f"{os.path.abspath(path)} is not a valid safetensors file: ", "")
    with open_regular(path) as f:
        legacy = f.read(len(_LEGACY)) == _LEGACY
    if legacy:
        raise CheckpointError(
            f"{os.path.abspath(path)} is a legacy torch.save file (_use_new_zipfile_serialization=False, the "
            "format before PyTorch 1.6), which load_checkpoint does not read: re-save it with torch.save "
            "(torch.save(torch.load(path, weights_only=True), path))."
        )
    raise CheckpointError(
        f"{os.path.abspath(path)} is neither a torch.save archive (it does not begin as a zip archive does) "
        f"nor a safetensors file: {reason}"
    )


def _state_dict(sd: Mapping) -> dict:
    entries = {}
    for key, t in flatten_tensors(dict(sd)):
        if getattr(t, "_local_tensor", None) is not None or type(t).__name__ == "DTensor":
            raise CheckpointError(
                f"the state dict's {key!r} is a DTensor; pass full tensors (DTensor.full_tensor()), "
                "or a checkpoint file, which each rank reads its own part of."
            )
        if is_fake(t):
            if getattr(t, "_record", None) is None:
                raise CheckpointError(
                    f"the state dict's {key!r} is a fake tensor from fake_mode, whose values are unknown."
                )
            entries[key] = Entry(DeferredValue(t), key, t.dtype, t.shape, 0, 0, t.stride())
        elif t.is_meta:
            raise CheckpointError(f"the state dict's {key!r} is on the meta device: it holds no values.")
        else:
            entries[key] = MemorySource.entry(key, t)
    return entries


def _directory(path: str) -> dict:
    index = next((os.path.join(path, n) for n in INDEX_FILES if os.path.exists(os.path.join(path, n))), None)
    files: dict[str, object] = {}
    entries: dict = {}
    if index is not None:
        inside(path, os.path.basename(index), "the folder")
        weight_map = read_index(index)
        for key, name in weight_map.items():
            file = files.get(name)
            if file is None:
                where = inside(path, name, f"the index {index}, for {key!r},")
                if not os.path.exists(where):
                    raise CheckpointNotFoundError(
                        f"the index {index} puts {key!r} in {name}, which does not exist ({os.path.abspath(where)}).",
                        os.path.abspath(where),
                    )
                try:
                    file = files[name] = open_file(where)
                except CheckpointNotFoundError:
                    raise
                except CheckpointError as e:
                    raise CheckpointError(f"{e} (the index {index} names it for {key!r})") from None
            entry = file.get(key)
            if entry is None:
                raise CheckpointError(f"{index} puts {key!r} in {name}, which has no such tensor.")
            entries[key] = entry
        return entries
    # The folder's name may hold glob's own characters ("ckpt[1]").
    names = sorted(glob.glob(os.path.join(glob.escape(path), "*.safetensors")))
    if not names:
        names = sorted(n for ext in ("bin", "pt", "pth") for n in glob.glob(os.path.join(glob.escape(path), f"*.{ext}")))
    if not names:
        raise CheckpointError(f"{os.path.abspath(path)} holds no *.safetensors, *.bin, *.pt or *.pth file.")
    for name in names:
        for key, entry in open_file(inside(path, os.path.basename(name), "the folder")).items():
            if key in entries:
                raise CheckpointError(
                    f"{key!r} is in both {entries[key].source.describe()} and {name}; pass one file, "
                    "or add an index (model.safetensors.index.json) that says which one holds it."
                )
            entries[key] = entry
    return entries
