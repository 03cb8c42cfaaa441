"""How many words of the CPU generator each random kernel draws, exactly, or that it is not known.

A replay jumps over draws whose values nobody reads (:mod:`deferinit.random.mt19937`)
instead of generating them; for that it needs the exact number of 32-bit
words each draw takes from the generator, and what else of the generator
it changes.  The counts of ATen's CPU kernels (torch 2.5 to 2.13):

* ``uniform_``, ``rand``: one word per element (float, half, bfloat16),
  two for double, in the order of the elements;
* ``normal_``, ``randn``: on a contiguous tensor of 16 elements or more, one
  uniform per element (two words for double), transformed 16 at a time,
  and when the size is no multiple of 16 the last 16 elements drawn again
  (16 uniforms more); half and bfloat16 draw only the whole blocks' words
  before those last 16.  Smaller or non-contiguous tensors take one
  Box-Muller pair (4 words) per two elements and keep the second sample
  of the last pair in the generator (``normal_y``), which the next such
  element uses first; ``log_normal_`` draws the same way;
* ``random_``, ``randint``: one word per element, two for the 64-bit
  types' full range (and for ranges of 2**28 and more: those fall back);
* ``randperm(n)``: ``n - 1`` words (below 2**24);
* ``bernoulli_(p)``, ``exponential_``, ``geometric_``, ``cauchy_``: two
  words per element where ATen draws them one by one (with MKL on an Intel
  CPU, ``bernoulli_`` and ``exponential_`` seed MKL's own stream instead).

Nothing here is taken on trust: each family of kernels is checked once
per process against the real generator (:func:`deferinit.random.jumps.verified`: several sizes
and dtypes, contiguous or not, a cached normal sample or none, drawn whole
or in parts) before a replay relies on it, and a family the checks
contradict, like any other call (``trunc_normal_``'s rejection loop, whose
count depends on the values drawn; tensor-valued means; ``multinomial``),
is generated as before.  :data:`FALLBACKS` counts those by name.

Example::

    >>> m = deferred_init(torch.nn.Linear, 4, 3)
    >>> c = consumption(m.weight._storage.head)    # the uniform_ of reset_parameters
    >>> c.words, c.layout
    (12, ('each', 1))
"""

from __future__ import annotations

import collections
from typing import NamedTuple

import torch

from deferinit.fake.flat import unflatten
from deferinit.fake.opinfo import bind

from ..ir.effects import contiguous
from ..ir.graph import Input

aten = torch.ops.aten

_FLOATS = {torch.float32: 1, torch.float16: 1, torch.bfloat16: 1, torch.float64: 2}
_REDUCED = (torch.float16, torch.bfloat16)
# random_() over the whole range of a type: words per element.
_FULL_RANGE = {
    torch.int64: 2, torch.float64: 2, torch.int32: 1, torch.int16: 1, torch.int8: 1, torch.uint8: 1,
    torch.bool: 1, torch.float32: 1, torch.float16: 1, torch.bfloat16: 1,
}
_SMALL_RANGE = 1 << 24  # ranges drawn with one word per element, in every torch from 2.5 on
_RANDPERM_MAX = 1 << 24


class Consumption(NamedTuple):
    """What one draw takes from a CPU generator.

    ``words``: 32-bit words drawn, not counting ``normals``; ``normals``:
    elements drawn by Box-Muller pairs through the cached sample (see the
    module docstring); ``layout``: how elements map to words, for drawing a
    part of the tensor only: ``("each", w)`` (``w`` words per element, in
    order), ``("blocks", w, tail_at)`` (blocks of 16 from word ``16 * w * b``;
    when the size is no multiple of 16 the last 16 elements from word
    ``tail_at``), or None (whole draws only).
    """

    words: int
    normals: int = 0
    layout: tuple | None = None
    family: str = ""


#: Draws generated (into scratch memory) instead of jumped, by name: the
#: calls whose count is not known exactly.
FALLBACKS: collections.Counter = collections.Counter()


def _numel(sizes) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def filled(node):
    """``(sizes, strides, dtype)`` of the tensor a random node fills, or None."""
    if node.writes:
        x = node.flat[node.writes[0]]
        if type(x) is Input:
            v = x.value
            return tuple(v.size), tuple(v.stride), v.dtype
        return None
    return node.filled


def _uniform(sizes, strides, dtype, family="uniform") -> Consumption | None:
    w = _FLOATS.get(dtype)
    if w is None:
        return None
    n = _numel(sizes)
    return Consumption(n * w, layout=("each", w) if contiguous(sizes, strides) else None, family=family)


def _normal(sizes, strides, dtype) -> Consumption | None:
    w = _FLOATS.get(dtype)
    if w is None:
        return None
    n = _numel(sizes)
    if n >= 16 and contiguous(sizes, strides):
        q, r = divmod(n, 16)
        tail_at = 16 * q * w if dtype in _REDUCED else n * w
        words = tail_at + 16 * w if r else n * w
        return Consumption(words, layout=("blocks", w, tail_at), family="normal")
    return Consumption(0, normals=n, family="normal")


def _random_range(sizes, strides, dtype, span) -> Consumption | None:
    if dtype not in _FULL_RANGE or span is None or not 0 < span <= _SMALL_RANGE:
        return None
    n = _numel(sizes)
    return Consumption(n, layout=("each", 1) if contiguous(sizes, strides) else None, family="random")


def _random_full(sizes, strides, dtype) -> Consumption | None:
    w = _FULL_RANGE.get(dtype)
    if w is None:
        return None
    n = _numel(sizes)
    return Consumption(n * w, layout=("each", w) if contiguous(sizes, strides) else None, family="random")


def _two_words(family):
    def count(sizes, strides, dtype, bound):
        if dtype not in _FLOATS:
            return None
        return Consumption(2 * _numel(sizes), layout=None, family=family)
    return count


def _span(low, high):
    if not isinstance(low, int) or not isinstance(high, int):
        return None
    return high - low


_FACTORY_RANDN = {"randn", "randn_like", "normal"}
_FACTORY_RAND = {"rand", "rand_like"}
_FACTORY_RANDINT = {"randint", "randint_like"}


def _count(node) -> Consumption | None:
    if node.kind != "op":
        return None
    op = node.target
    name = op._opname
    geometry = filled(node)
    if name == "randperm":
        args, kwargs = unflatten(node.flat, node.spec)
        n = bind(op, args, kwargs).get("n")
        if not isinstance(n, int) or not 0 <= n < _RANDPERM_MAX:
            return None
        return Consumption(max(n - 1, 0), family="randperm")
    if geometry is None:
        return None
    sizes, strides, dtype = geometry
    args, kwargs = unflatten(node.flat, node.spec)
    bound = bind(op, args, kwargs)
    if any(type(v) is Input for k, v in bound.items() if k not in ("self", "input")):
        return None  # tensor-valued parameters (normal with tensor means, bernoulli_(Tensor p))
    if name == "uniform_" or name in _FACTORY_RAND:
        return _uniform(sizes, strides, dtype)
    if name == "normal_" or (name in _FACTORY_RANDN and op._overloadname in ("default", "generator", "float_float", "names", "generator_with_names", "float_float_out")):
        return _normal(sizes, strides, dtype)
    if name == "log_normal_":
        return Consumption(0, normals=_numel(sizes), family="log_normal") if dtype in _FLOATS else None
    if name == "random_":
        overload = op._overloadname
        if overload == "default":
            return _random_full(sizes, strides, dtype)
        if overload == "to":
            return _random_range(sizes, strides, dtype, _span(0, bound.get("to")))
        if overload == "from":
            return _random_range(sizes, strides, dtype, _span(bound.get("from"), bound.get("to")))
        return None
    if name in _FACTORY_RANDINT:
        high = bound.get("high")
        low = bound.get("low", 0)
        return _random_range(sizes, strides, dtype, _span(low, high))
    if name in ("bernoulli_",) and op._overloadname == "float":
        return _two_words("bernoulli")(sizes, strides, dtype, bound)
    if name in ("exponential_", "geometric_", "cauchy_"):
        return _two_words(name.rstrip("_"))(sizes, strides, dtype, bound)
    return None


def consumption(node) -> Consumption | None:
    """What random ``node`` takes from a CPU generator, or None when that is not
    known exactly.  Replay relies on it only once its family passed
    :func:`deferinit.random.jumps.verified` (see :func:`deferinit.random.jumps.checked`)."""
    return _count(node)


def fallback(node) -> None:
    """Count ``node`` as drawn instead of jumped (see :data:`FALLBACKS`)."""
    FALLBACKS[node.name] += 1
