"""The Materialize layer: replay a record on real hardware, exactly and in place.

Example::

    >>> import torch
    >>> from deferinit import deferred_init
    >>> from deferinit.materialize import materialize_module
    >>> _ = torch.manual_seed(0)
    >>> m = deferred_init(torch.nn.Linear, 4, 4)
    >>> materialize_module(m).weight.is_meta
    False
"""

from .api import materialize_module, materialize_tensor
from .checkpoint import LoadResult, load_checkpoint

__all__ = ["materialize_module", "materialize_tensor", "load_checkpoint", "LoadResult"]

from deferinit.fake.compiling import skip_compiling as _skip_compiling  # noqa: E402

_skip_compiling("deferinit")  # modules deferinit imported for us since
_skip_compiling("deferinit.materialize")  # see fake/compiling.py
