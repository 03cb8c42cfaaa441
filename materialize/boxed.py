"""Calling recorded ATen overloads through the dispatcher's boxed entry, the short way.

A replay calls every recorded operator once, below modes, subclass handlers
and torch functions (:class:`deferinit.fake.bypass.no_python_dispatch`).
``OpOverload.__call__`` spends most of a small tensor's call on the way in
(a Python frame, then the TorchScript binding, which looks for torch
function overrides before it builds the argument stack): twice the kernel's
own time for ``randn(4)``.  ``torch._C._dispatch_call_boxed`` builds the same
stack from the overload's schema and calls the same dispatcher entry, so the
kernels, their results and the generators they draw from are the same.  Only
ATen overloads whose arguments the record always holds as the schema says
go this way (factories, in-place fills: see :func:`_plain_arguments`);
anything else (an opaque Python initialiser, ``mul_`` by a Python number)
is called as it is.
"""

from __future__ import annotations

import functools

import torch

_call_boxed = torch._C._dispatch_call_boxed
_find = torch._C._dispatch_find_schema_or_throw

# id(overload) -> (overload, its callable): the overload is kept, so its id
# stays its own.
_CALLERS: dict = {}


def caller(target):
    """A callable equal to ``target`` under the replay's dispatch state: the boxed
    dispatcher call for an ATen ``OpOverload``, ``target`` itself otherwise.

    Example::

        >>> from deferinit.fake.bypass import no_python_dispatch
        >>> g = torch.Generator().manual_seed(0)
        >>> with no_python_dispatch():
        ...     a = caller(torch.ops.aten.randn.generator)([3], generator=g)
        >>> torch.equal(a, torch.randn(3, generator=torch.Generator().manual_seed(0)))
        True
    """
    found = _CALLERS.get(id(target))
    if found is not None:
        return found[1]
    if type(target) is not torch._ops.OpOverload:
        return target
    schema = target._schema
    call = target
    if _plain_arguments(schema):
        call = functools.partial(_call_boxed, _find(schema.name, schema.overload_name))
    _CALLERS[id(target)] = (target, call)
    return call


def _plain_arguments(schema) -> bool:
    """Whether the boxed call takes what a record holds for every argument: a
    record may hold a Python number where the schema asks for a tensor
    (``t.mul_(-1)``), which only the TorchScript binding converts.  So: no
    tensor argument but, for an in-place op, the tensor it writes (a
    factory, a random fill)."""
    for i, arg in enumerate(schema.arguments):
        if "Tensor" in str(arg.type):
            written = arg.alias_info is not None and arg.alias_info.is_write
            if i != 0 or not written:
                return False
    return True
