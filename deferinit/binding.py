"""A fake's binding to its record: the record, value and storage a deferred fake holds.

Example::

    >>> from deferinit import deferred_init
    >>> m = deferred_init(torch.nn.Linear, 2, 2)
    >>> is_deferred_fake(m.weight), is_deferred_fake(torch.ones(1))
    (True, False)
"""

from __future__ import annotations

import torch

from deferinit.fake.tensor import FakeTensor, describe

from .errors import RecordingError
from .ir.graph import Storage, Value


def attach(fake: FakeTensor, record, value: Value, storage: Storage) -> FakeTensor:
    """Bind ``fake`` to ``value`` on ``storage`` of ``record`` (its recipe from now on)."""
    d = fake.__dict__
    d["_record"] = record
    d["_value"] = value
    d["_storage"] = storage
    return fake


def is_deferred_fake(t) -> bool:
    """Whether ``t`` is a fake whose recipe is recorded."""
    return isinstance(t, FakeTensor) and t._record is not None


def check_storage_not_real(fake: FakeTensor, op) -> None:
    """Refuse to record a write to a deferred tensor whose memory is already real.

    Once a tensor is materialized, its views still deferred read the real
    memory; a write recorded now would only be replayed when the view is
    materialized, after whatever was done to the real memory in between.
    """
    storage = fake.__dict__.get("_storage")
    if storage is not None and storage.real is not None:
        raise RecordingError(
            f"{getattr(op, '__name__', op)} writes a deferred tensor {describe(fake)} that shares "
            "memory with a tensor already materialized, so the write would be replayed out of "
            "order. Materialize this tensor first (materialize_tensor), then write to it."
        )
