"""A checkpoint folder's index, and which files a folder may name.

transformers' ``model.safetensors.index.json`` (or
``pytorch_model.bin.index.json``) is a JSON object whose ``weight_map``
maps each tensor's key to the file holding it.  Both the index and the
files are untrusted: the structure is checked, and a file name must stay
inside the folder: relative, without ``..``, and not a symbolic link to a
file elsewhere.  One place outside is allowed, because the Hugging Face
cache is laid out that way: a folder inside a cache snapshot
(``.../snapshots/<revision>/``) holds links to the same repository's
``blobs/``, and files there may be read.
"""

from __future__ import annotations

import json
import os

from .errors import CheckpointError
from .files import open_regular

# An index names each tensor's file: transformers' largest are a few MiB.
MAX_INDEX = 64 << 20


def _within(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def _cache_blobs(root: str) -> str | None:
    """``<repo>/blobs`` when ``root`` is inside ``<repo>/snapshots/<revision>``."""
    parts = root.split(os.sep)
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots":
            blobs = os.sep.join(parts[:i] + ["blobs"])
            return blobs if os.path.isdir(blobs) else None
    return None


def inside(folder: str, name, what: str) -> str:
    """The path of the file ``name`` of ``folder``, refused (``CheckpointError``
    naming ``what``) when it would be read from outside the folder.

    Example::

        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> inside(folder, "model.safetensors", "the index").endswith("model.safetensors")
        True
        >>> inside(folder, "../secret.safetensors", "the index")
        Traceback (most recent call last):
        ...
        deferinit.materialize.checkpoint.errors.CheckpointError: the index names '../secret.safetensors', a path outside ...
    """
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{what} names {name!r}, not a file name.")
    parts = name.replace(os.sep, "/").split("/")
    if os.path.isabs(name) or ".." in parts or "\0" in name:
        raise CheckpointError(
            f"{what} names {name!r}, a path outside {folder}: only files inside the folder are read."
        )
    path = os.path.join(folder, name)
    root = os.path.realpath(folder)
    real = os.path.realpath(path)
    blobs = _cache_blobs(root)
    if not _within(real, root) and not (blobs is not None and _within(real, blobs)):
        raise CheckpointError(
            f"{what} names {name!r}, a symbolic link to {real}, outside {folder}: only files inside "
            "the folder are read."
        )
    return path


def read_index(index: str) -> dict:
    """``key -> file name`` of an index file, its structure checked; a FIFO,
    a device or a file of more than ``MAX_INDEX`` bytes is refused."""
    try:
        with open_regular(index) as f:
            text = f.read(MAX_INDEX + 1)
        if len(text) > MAX_INDEX:
            raise CheckpointError(f"the index {index} has more than {MAX_INDEX} bytes (load_checkpoint reads at most that).")
        content = json.loads(text.decode("utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"cannot read the index {index}: {type(e).__name__}: {e}") from None
    if not isinstance(content, dict):
        raise CheckpointError(f"the index {index} is a JSON {type(content).__name__}, not an object with a 'weight_map'.")
    weight_map = content.get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(
            f"the index {index} has {'no' if weight_map is None else 'a ' + type(weight_map).__name__} "
            "'weight_map', not an object of tensor names to file names."
        )
    for key, name in weight_map.items():
        if not isinstance(name, str):
            raise CheckpointError(f"the index {index} puts {key!r} in {name!r}, not a file name.")
    return weight_map
