"""The storage of a fake tensor: its shadow's meta storage, which knows its size.

Tools that account for memory (``MemTracker``, ``FSDPMemTracker``) and code
that manages memory by hand (FSDP2 frees and re-allocates its all-gather
buffers with ``untyped_storage().resize_()``) ask a tensor for its
storage, as they do of PyTorch's own fake tensors.  A fake answers with
the untyped storage of its shadow: PyTorch keeps one Python object per
storage, so the fakes that alias one memory (views, ``detach()``,
``.data``, in-place results) answer with the same object, which reports
the bytes the real memory would hold (``nbytes()``, ``size()``), takes
weak references, dies with its last alias and can be resized.

What it cannot do is hold data: the object is given the class
:class:`FakeStorage`, whose data accessors raise
:class:`~deferinit.fake.errors.FakeDataAccessError` instead of meta's bare
``NotImplementedError``.  Metadata methods, ``resize_`` included, are
inherited untouched, so a tool that patches ``UntypedStorage.resize_`` (as
``MemTracker`` does) still sees every resize.
"""

from __future__ import annotations

import torch

from .errors import FakeDataAccessError


def _refuse(operation: str):
    def method(self, *args, **kwargs):
        raise FakeDataAccessError(
            f"UntypedStorage.{operation}",
            f"(size={self.nbytes()} bytes: its storage)",
            "The storage of a fake tensor knows its size but holds no bytes; "
            "materialize the tensor first to read or write its memory.",
        )

    method.__name__ = operation.partition("(")[0]
    return method


class FakeStorage(torch.UntypedStorage):
    """The untyped storage of fake tensors: sizes, weak references and resizes
    work; reading or writing bytes raises :class:`~deferinit.fake.errors.FakeDataAccessError`.

    Example::

        >>> with fake_mode():
        ...     t = torch.ones(4, 4)
        >>> s = t.untyped_storage()
        >>> type(s).__name__, s.nbytes(), s is t[1:].untyped_storage()
        ('FakeStorage', 64, True)
        >>> s.tolist()
        Traceback (most recent call last):
        deferinit.fake.errors.FakeDataAccessError: UntypedStorage.tolist() needs the data of a fake tensor ...
    """

    tolist = _refuse("tolist()")
    __getitem__ = _refuse("__getitem__()")
    __setitem__ = _refuse("__setitem__()")
    __iter__ = _refuse("__iter__()")
    data_ptr = _refuse("data_ptr()")
    copy_ = _refuse("copy_()")
    fill_ = _refuse("fill_()")
    cpu = _refuse("cpu()")
    cuda = _refuse("cuda()")
    to = _refuse("to()")
    numpy = _refuse("numpy()")
    pin_memory = _refuse("pin_memory()")
    share_memory_ = _refuse("share_memory_()")
    _write_file = _refuse("_write_file()")
    __reduce__ = _refuse("pickling")
    __deepcopy__ = _refuse("copy.deepcopy()")

    def __repr__(self) -> str:
        return f"FakeStorage(nbytes={self.nbytes()})"


def storage_of(shadow: torch.Tensor) -> FakeStorage:
    """The storage of the fakes that ``shadow`` (a meta tensor) stands for.

    The same object for every alias of that memory, for as long as one lives.
    """
    storage = torch.Tensor.untyped_storage(shadow)
    if type(storage) is not FakeStorage:
        # PyTorch keeps this object while the storage lives: giving it our
        # class once is enough, and costs no copy.
        storage.__class__ = FakeStorage
    return storage
