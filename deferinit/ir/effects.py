"""What a recorded node does to memory, for the liveness pass (:mod:`deferinit.ir.liveness`).

Which writes cover their tensor without reading it, which inputs only lend
their geometry, where a storage comes from, and the two ways a checkpoint
load is read in less than whole: only the parts of it that are read
(:func:`load_parts`), or straight into the destination of a ``copy_`` that
reads it (:func:`direct_copy`), only the parts of that destination that
are read (:func:`direct_parts`).

A *load* (:func:`is_load`) is a checkpoint load node or a copy from a real
tensor recorded after deferral.

Example::

    >>> m = deferred_init(torch.nn.Linear, 2, 3)
    >>> node = m.weight._storage.head          # the uniform_ of reset_parameters
    >>> overwrites(node), is_view(node)
    (True, False)
"""

from __future__ import annotations

import torch

from deferinit.fake.flat import unflatten
from deferinit.fake.opinfo import op_info

from .boxes import as_box
from .graph import Input
from .regions import Region

aten = torch.ops.aten

# In-place ops that write every element of their first argument without reading it.
OVERWRITES = frozenset({
    aten.copy_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default,
    aten.uniform_.default, aten.normal_.default, aten.random_.default, getattr(aten.random_, "from"),
    aten.random_.to, aten.bernoulli_.float, aten.bernoulli_.Tensor, aten.exponential_.default,
    aten.log_normal_.default, aten.cauchy_.default, aten.geometric_.default,
})

# Factories that read only the geometry, dtype and device of their first argument.
GEOMETRY_ONLY = frozenset({
    aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
    aten.rand_like.default, aten.randn_like.default, aten.randint_like.default, aten.randint_like.low_dtype,
    aten.randint_like.Tensor, aten.randint_like.generator, aten.randint_like.low_generator_dtype,
    aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
    aten.new_empty_strided.default,
})

# Operators whose output element i is computed from input element i alone,
# into fresh memory: a part of the output needs only that part of the input.
ELEMENTWISE_COPIES = frozenset({aten.clone.default, aten._to_copy.default})

# Factories whose every element is one number: that number, or the position
# of the argument that holds it.
_CONSTANT = {
    aten.zeros.default: 0, aten.new_zeros.default: 0, aten.zeros_like.default: 0,
    aten.ones.default: 1, aten.new_ones.default: 1, aten.ones_like.default: 1,
}
_CONSTANT_ARG = {aten.full.default: 1, aten.new_full.default: 2, aten.full_like.default: 1}


def constant_fill(node):
    """The number every element of ``node``'s output holds when ``node`` is a
    factory of one constant (``zeros``, ``new_zeros``, ``ones_like``,
    ``full``...), else None: its output can be allocated and filled only where
    its bytes are read (FSDP2's padded shards: the padding).

    Example::

        >>> ps = deferred_init(lambda: torch.nn.ParameterList([torch.nn.Parameter(torch.full((2,), 3.0))]))
        >>> constant_fill(ps[0]._value.node)
        3.0
    """
    if node.kind != "op" or node.writes or node.reshapes:
        return None
    found = _CONSTANT.get(node.target)
    if found is not None:
        return found
    at = _CONSTANT_ARG.get(node.target)
    if at is None:
        return None
    args, _ = unflatten(list(node.flat), node.spec)
    value = args[at] if len(args) > at else None
    return value if type(value) in (int, float, bool) else None


def overwrites(node) -> bool:
    """Whether ``node`` writes every element of its first argument without reading it."""
    if node.writes != (0,) or node.reshapes:
        return False
    if node.kind in ("load", "opaque"):
        # Opaque nodes are data-dependent initialisers (trunc_normal_), which
        # start by drawing over the whole tensor.
        return True
    return node.kind == "op" and node.target in OVERWRITES


def is_load(node) -> bool:
    """Whether ``node`` puts values from outside the record over a whole tensor
    after ``deferred_init`` returned: a checkpoint load, or a ``copy_`` from a
    real tensor recorded then (``load_state_dict``'s ``param.copy_(input)``,
    or any such copy).  The draws such a write hides are the initialization
    it replaces: the generators do not wait for them (see
    :mod:`deferinit.ir.liveness`).  A copy made while constructing is part of
    construction, not a load.

    Example::

        >>> m = deferred_init(torch.nn.Linear, 2, 2)
        >>> _ = m.load_state_dict({"weight": torch.ones(2, 2), "bias": torch.ones(2)})
        >>> is_load(m.bias._storage.head)
        True
    """
    if node.kind == "load":
        return True
    if not node.after_deferral or node.target is not aten.copy_.default or node.writes != (0,) or node.reshapes:
        return False
    source = node.flat[1] if len(node.flat) > 1 else None
    return type(source) is Input and source.value.node.kind in ("external", "constant")


def is_view(node) -> bool:
    if node.kind != "op" or node.writes:
        return False
    found = _VIEW_OPS.get(id(node.target))
    if found is None:
        found = _VIEW_OPS[id(node.target)] = (node.target, op_info(node.target).view_arg is not None)
    return found[1]


# id(op) -> (op, whether it makes a view): asked per node on records of many
# tensors, and OpOverload's hash, which op_info's cache needs, is Python code
# (the op is kept, so its id stays its own).
_VIEW_OPS: dict = {}


def contiguous(sizes, strides) -> bool:
    expected = 1
    for n, s in reversed(list(zip(sizes, strides))):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def root_value(value):
    """The value that created ``value``'s storage (following views), or None when
    its storage changed geometry in place on the way (then it is not analysed)."""
    v = value
    while True:
        node = v.node
        if node.reshapes:
            return None
        if not is_view(node):
            return v
        base = next((x for x in node.flat if type(x) is Input), None)
        if base is None:
            return None
        v = base.value



def allocatable(node, outs) -> bool:
    """Whether ``node``'s needed outputs can be allocated instead of computed:
    a fresh-output operator whose outputs are dense, at offset 0."""
    if node.kind != "op" or node.writes or node.reshapes:
        return False
    for value in outs.values():
        region = Region.of(value)
        if value.offset != 0 or (region is not None and not region.dense):
            return False
    return True

def direct_copy(node, real_read):
    """A ``copy_`` whose source holds exactly bytes a checkpoint load wrote:
    ``(load, (offset, sizes, strides))`` to read them straight into the
    destination, or None."""
    dst, src = node.flat[0], node.flat[1] if len(node.flat) > 1 else None
    if type(src) is not Input or type(dst) is not Input or real_read(src):
        return None
    load = src.version
    if load is None or load.kind != "load" or not getattr(load.payload, "contiguous", False):
        return None
    whole = load.flat[0].value
    part = src.value
    if part.dtype != whole.dtype or part.size != dst.value.size or not contiguous(whole.size, whole.stride):
        return None
    outer, inner = Region.of(whole), Region.of(part)
    if outer is None or inner is None or not outer.covers(inner):
        return None
    return (load, (part.offset - whole.offset, part.size, part.stride))

def direct_parts(value, region, found):
    """The parts of a direct copy's destination ``value`` that are demanded, as
    boxes of its indices (``(start, sizes)``), or None for all of it (a shard
    FSDP2 cuts from a tensor-parallel piece reads only its own rows)."""
    size = value.dtype.itemsize
    boxes = []
    for r, _ in found:
        if r.covers(region):
            return None
        # A box of the destination's indices is inside it (a demand that only
        # meets its bytes, the padding between its rows, is not one).
        part = r.in_elements(size, value.offset * size)
        box = None if part is None else as_box(*part, value.size, value.stride)
        if box is None:
            return None
        boxes.append(box)
    return boxes


def copied_parts(src, out, found):
    """The regions of ``src`` that the demanded parts ``found`` of ``out`` (the
    output of an elementwise copy of it) are computed from, or None for all
    of it (a ``contiguous()`` FSDP2 takes of a tensor-parallel piece, of which
    it keeps a row block)."""
    if src.size != out.size:
        return None
    out_size, src_size = out.dtype.itemsize, src.dtype.itemsize
    regions = []
    for r, _ in found:
        part = r.in_elements(out_size, out.offset * out_size)
        box = None if part is None else as_box(*part, out.size, out.stride)
        if box is None:
            return None
        start, sizes = box
        offset = src.offset + sum(i * s for i, s in zip(start, src.stride))
        regions.append(Region(offset * src_size, sizes, tuple(s * src_size for s in src.stride), src_size))
    return regions


def load_parts(node, value, region, found):
    """The parts of a load's tensor that are demanded, in its elements
    (``(offset, sizes, strides)`` from its first element), or None for all of it."""
    if not getattr(node.payload, "contiguous", False) or not contiguous(value.size, value.stride):
        return None
    size = value.dtype.itemsize
    parts = []
    for r, _ in found:
        if not region.covers(r) or r.covers(region):
            return None
        part = r.in_elements(size, value.offset * size)
        if part is None:
            return None
        parts.append(part)
    return parts


def drawn_part(value, region, found):
    """``(lo, hi)``: the elements of a random fill of contiguous ``value`` that the
    demands ``found`` meet (the hull of their bytes), or None when that is all
    of it (a shard's rows of a parameter drawn whole eagerly: the replay
    draws only those where the kernel allows, see :mod:`deferinit.random.jumps`)."""
    if not found or not region.dense or any(r.covers(region) for r, _ in found):
        return None
    if not contiguous(value.size, value.stride):
        return None
    lo = max(region.lo, min(r.lo for r, _ in found))
    hi = min(region.hi, max(r.hi for r, _ in found))
    size = value.dtype.itemsize
    first, last = (lo - region.lo) // size, -(-(hi - region.lo) // size)
    numel = (region.hi - region.lo) // size
    if first <= 0 and last >= numel or last <= first:
        return None
    return first, last
