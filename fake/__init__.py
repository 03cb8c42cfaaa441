"""The Fake layer: tensors that report a device, a shape and a dtype, and own no memory.

Example::

    >>> import torch
    >>> from deferinit.fake import fake_mode, is_fake, meta_like
    >>> with fake_mode(fake_cuda=True):
    ...     x = torch.ones(2, 3, device="cuda")
    >>> x
    tensor(..., size=(2, 3), device='cuda:0', fake=True)
    >>> is_fake(x), meta_like(x).device
    (True, device(type='meta'))
"""

from .errors import FakeDataAccessError, FakeIntoRealError, FakeTensorError, UnsupportedOperatorError
from .storage import FakeStorage
from .tensor import FakeTensor, is_fake, meta_like
from . import dispatch as _dispatch  # noqa: F401  (installs the plain handler)
from .mode import fake_mode
from . import assign as _assign  # noqa: F401  (real.data = fake; installed while fakes live, fake/alive.py)

__all__ = [
    "FakeStorage",
    "FakeTensor",
    "FakeDataAccessError",
    "FakeIntoRealError",
    "FakeTensorError",
    "UnsupportedOperatorError",
    "fake_mode",
    "is_fake",
    "meta_like",
]

from .compiling import skip_compiling as _skip_compiling

_skip_compiling("deferinit.fake")  # torch.compile runs our code as written: see fake/compiling.py
