"""Tensors over memory that already exists: files, storages, buffers.

``torch.load`` rebuilds each tensor on a storage read from the file, and
inside a fake mode that tensor is real (see :mod:`deferinit.fake.storage`): its
values come from outside the program, which a record could not reproduce
(the file may change), and eagerly it aliases that memory.  The same holds
for PyTorch's other ways of making a tensor over memory that exists:
``torch.asarray`` of a storage (how safetensors' ``safe_open`` and
``load_file`` read), ``torch.from_file`` and ``torch.frombuffer``.  Under the
fake modes C++ would build them on a fake made by ``torch.empty`` and fail,
or record a read of the file for later; so they are made here with the
modes off: real tensors, as eagerly.  A device the Fake layer stands for
(``cuda`` on a CPU-only build) is then reached by ``.to(device)`` under the
modes, as for ``torch.tensor(data, device="cuda")``.
"""

from __future__ import annotations

import torch

from .bypass import no_python_dispatch
from .device import normalize
from .function import needs_rewrite, tensor_to
from .storage import FakeStorage

#: The functions that may make a tensor over existing memory.
READS = frozenset({torch.asarray, torch.from_file, torch.frombuffer})
_CPU = torch.device("cpu")
_STORAGES = (torch.UntypedStorage, torch.TypedStorage)


def reads_memory(func, args, kwargs) -> bool:
    """Whether ``func(*args, **kwargs)`` makes a tensor over existing memory.

    Example::

        >>> storage = torch.UntypedStorage.from_buffer(b"abcd", dtype=torch.uint8)
        >>> reads_memory(torch.asarray, (storage,), {}), reads_memory(torch.asarray, ([1, 2],), {})
        (True, False)
    """
    if func is torch.asarray:
        obj = args[0] if args else kwargs.get("obj")
        return isinstance(obj, _STORAGES) and not isinstance(obj, FakeStorage) and not isinstance(
            getattr(obj, "_untyped_storage", None), FakeStorage
        )
    return func in READS


def read(func, args, kwargs, fake_cuda: bool = True) -> torch.Tensor:
    """``func(*args, **kwargs)`` with the fake modes off: a real tensor over that
    memory; moved under the modes where the device asked for is one the Fake
    layer stands for (``cuda`` on a CPU-only build, with ``fake_cuda``).

    Example::

        >>> with fake_mode():
        ...     t = read(torch.frombuffer, (bytearray(b"ab"),), {"dtype": torch.uint8})
        >>> is_fake(t), t.tolist()
        (False, [97, 98])
    """
    device = kwargs.get("device")
    target = normalize(device) if device is not None else None
    if target is not None and needs_rewrite(target, fake_cuda):
        kwargs = dict(kwargs, device=_CPU)
    else:
        target = None
    requires_grad = kwargs.pop("requires_grad", False) if target is not None else False
    with no_python_dispatch():
        t = func(*args, **kwargs)
    if target is None:
        return t
    t = tensor_to(t, (target,), {}, fake_cuda)  # under the dispatch mode: a fake
    if requires_grad:
        t.requires_grad_(True)
    return t
