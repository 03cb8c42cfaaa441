"""A pointwise result written into the memory of the input that dies with it.

Replay frees each value at its last use, but an out-of-place operator needs
its output allocated while its input is still alive: a chain of pointwise
ops on a tensor (a quantization's ``w * (1/scale)``, ``round``, ``+ zero``,
``clamp`` before the cast to int8) holds two tensors of that size at every
step.  When the first input of a pointwise operator is read for the last
time, nothing else holds its memory, and the result has exactly its
geometry and dtype (as the record says), the interpreter runs the
operator's in-place form on it instead: the same kernel, the same values
(eager's in-place and out-of-place forms share their implementation), and
a full-precision tensor costs its own size while it is transformed, not
twice that.

Example::

    >>> in_place_variant(torch.ops.aten.mul.Tensor)
    <OpOverload(op='aten.mul_', overload='Tensor')>
    >>> in_place_variant(torch.ops.aten.pow.Tensor_Scalar)
    <OpOverload(op='aten.pow_', overload='Scalar')>
    >>> in_place_variant(torch.ops.aten.view.default) is None
    True
"""

from __future__ import annotations

import sys

import torch

from deferinit.ir.graph import Input
from deferinit.ir.plan import real_read

_use_count = torch._C._storage_Use_Count
_VARIANTS: dict = {}


def in_place_variant(func):
    """The in-place overload of pointwise ATen operator ``func`` taking the same
    arguments (``aten.mul.Tensor`` -> ``aten.mul_.Tensor``), or None."""
    try:
        return _VARIANTS[func]
    except (KeyError, TypeError):
        pass
    found = None
    schema = getattr(func, "_schema", None)
    if (
        schema is not None
        and torch.Tag.pointwise in getattr(func, "tags", ())
        and func.namespace == "aten"
        and not schema.is_mutable
        and len(schema.returns) == 1
        and schema.arguments
        and str(schema.arguments[0].type) == "Tensor"
    ):
        packet = getattr(torch.ops.aten, schema.name.split("::")[-1] + "_", None)
        wanted = _signature(schema)
        for name in packet.overloads() if packet is not None else ():
            candidate = getattr(packet, name)
            if _signature(candidate._schema) == wanted and candidate._schema.arguments[0].is_write:
                found = candidate
                break
    _VARIANTS[func] = found
    return found


def _signature(schema) -> list:
    return [(a.name, str(a.type), a.kwarg_only) for a in schema.arguments]


def _sole_references() -> tuple[int, int]:
    """The Python references and storage uses of a tensor held by one dict entry
    only, as :func:`reusable` sees them (calibrated on this interpreter)."""
    env = {0: torch.empty(1)}
    return _counts(env, 0)


def _counts(env, key) -> tuple[int, int]:
    t = env[key]
    return sys.getrefcount(t), _use_count(t.untyped_storage()._cdata)


def reusable(replay, node, env, uses, produced, borrowed) -> bool:
    """Whether ``node`` may run in place on its first input (see the module docstring).

    ``uses`` counts the reads still to come of each value (this node's
    included), ``produced`` gives the recorded geometry of node outputs,
    ``borrowed`` the ids of tensors the replay does not own (outside
    tensors read by reference), which may be the base of a view.
    """
    if (
        node.kind != "op"
        or node.rng is not None
        or node.writes
        or node.reshapes
        or node.autograd.data_swap
        or (node.autograd.grad is not None and replay.autograd is not None)
        or in_place_variant(node.target) is None
    ):
        return False
    first = node.flat[0] if node.flat else None
    if type(first) is not Input or real_read(first):
        return False
    key = first.value.key
    if uses.get(key) != 1 or key not in env:
        return False
    out = produced.get((node, 0))
    t = env[key]
    if (
        out is None
        or type(t) is not torch.Tensor
        or t.requires_grad
        or t.dtype != out.dtype
        or tuple(t.shape) != out.size
        or t.storage_offset() != 0
        or out.offset != 0
        or not t.is_contiguous()
        or any(a != b and n != 1 for a, b, n in zip(out.stride, t.stride(), out.size))
        or t.untyped_storage().nbytes() != t.numel() * t.element_size()
    ):
        return False
    holders = 0
    if t._is_view():
        # A view keeps its base alive (its _base), which must be dead too: no
        # other value of the replay, no outside tensor.
        base = t._base
        if id(base) in borrowed or any(v is base for v in env.values()):
            return False
        holders = 1
        del base
    del t
    # An outside tensor is also held by its node (the record keeps it by
    # reference): more references than env's, so never written.
    refs, storage_uses = _counts(env, key)
    return refs == SOLE[0] and storage_uses == SOLE[1] + holders


SOLE = _sole_references()
