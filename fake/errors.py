"""Errors raised by the Fake layer."""

from __future__ import annotations


class FakeTensorError(RuntimeError):
    """Base class of the errors the Fake layer raises."""


class FakeDataAccessError(FakeTensorError):
    """A fake tensor was asked for its data.

    Fake tensors carry shape, dtype, strides, a device and the size of their
    storage, but no data, so anything that needs the numbers (``item()``,
    ``tolist()``, ``numpy()``, ``bool()``, ``data_ptr()``, formatting values,
    the bytes of their storage) cannot be answered.  Tensors whose values
    are known (made from Python numbers, shapes and ``arange``, and what is
    computed from them alone, see :mod:`deferinit.fake.constants`) are the exception.

    Example::

        >>> from deferinit.fake import fake_mode
        >>> with fake_mode():
        ...     t = torch.randn(3)
        >>> t.tolist()
        Traceback (most recent call last):
        deferinit.fake.errors.FakeDataAccessError: tolist() needs the data of a fake tensor ...
    """

    def __init__(self, operation: str, tensor_desc: str, hint: str | None = None):
        self.operation = operation
        self.tensor_desc = tensor_desc
        message = (
            f"{operation} needs the data of a fake tensor {tensor_desc}, and fake "
            "tensors hold no data: only shape, dtype, strides, device and the size of their memory."
        )
        message += " " + (
            hint
            or "Compute it on a real tensor, or materialize the tensor first "
            "(deferinit.materialize_tensor) if it was created by deferred_init."
        )
        super().__init__(message)


class UnsupportedOperatorError(FakeTensorError):
    """An operator cannot run on fake tensors: it has no meta kernel, and the
    shape of its output depends on the data (``nonzero``, ``unique``, boolean
    masks), or it draws random numbers, or stand-ins would be too large.

    Deliberately not a ``NotImplementedError``: PyTorch
    (``parametrize``'s ``right_inverse``) and user code catch that to mean
    "not implemented here, take another path", which would silently build
    something else than eager PyTorch does."""


class FakeIntoRealError(FakeTensorError):
    """An in-place operation would write fake data into a real tensor."""
