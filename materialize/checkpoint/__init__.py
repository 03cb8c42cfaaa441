"""Checkpoints into modules: ``load_checkpoint``, lazily on deferred tensors.

``api.py`` (the entry point), ``sources.py`` (what a source may be),
``files.py`` (sources read by position: safetensors and ``torch.save``
files), ``archive.py`` (a ``torch.save`` archive as torch's own loader
reads it), ``pickle_scan.py`` (the guard of every pickle),
``entries.py`` (one tensor of a checkpoint), ``copying.py`` (strided
reads straight into a tensor), ``capture.py`` (the module's own
``load_state_dict`` run on stand-ins), ``matching.py`` (keys, and what to
say when they do not fit), ``loading.py`` (load nodes on deferred tensors,
staged copies into real ones), ``undo.py`` (what a failed call puts back),
``blocks.py`` (the block a DTensor holds), ``dcp.py`` with
``dcp_metadata.py`` (PyTorch distributed checkpoints),
``fingerprints.py`` (digests of loaded values ranks compare).

Example::

    >>> m = deferred_init(torch.nn.Linear, 2, 3)
    >>> load_checkpoint(m, {"weight": torch.ones(3, 2)}, strict=False)
    LoadResult(missing_keys=['bias'], unexpected_keys=[])
"""

from .api import load_checkpoint
from .matching import LoadResult

__all__ = ["load_checkpoint", "LoadResult"]
