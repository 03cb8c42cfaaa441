"""Skipping draws on a CPU generator: how many words each random kernel draws, jumped over, or drawn only in part.

A replay jumps over draws whose values nobody reads
(:mod:`deferinit.random.mt19937`) instead of generating them; for that it
needs the exact number of 32-bit words each draw takes from the generator,
and what else of the generator it changes.  The counts of ATen's CPU
kernels (torch 2.5 to 2.13):

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
per process against the real generator (:func:`verified`: several sizes
and dtypes, contiguous or not, a cached normal sample or none, drawn whole
or in parts) before a replay relies on it, and a family the checks
contradict, like any other call (``trunc_normal_``'s rejection loop, whose
count depends on the values drawn; tensor-valued means; ``multinomial``),
is generated as before.  :data:`FALLBACKS` counts those by name.

A :class:`Cursor` owes the words of the draws it skips and pays them only
when a real draw needs the state: a run of skipped draws costs one jump
(:func:`deferinit.random.mt19937.advance`) whatever its length.
:func:`draw_part` draws only elements ``[lo, hi)`` of a tensor a kernel
fills in order (docs/materialize.md, "Reaching the generator's state").

Example::

    >>> m = deferred_init(torch.nn.Linear, 4, 3)
    >>> c = consumption(m.weight._storage.head)    # the uniform_ of reset_parameters
    >>> c.words, c.layout
    (12, ('each', 1))
    >>> cursor = Cursor(torch.Generator().manual_seed(0))
    >>> cursor.skip(Consumption(10**9))            # a billion words, not drawn
    >>> state = cursor.settle()
"""

from __future__ import annotations

import collections
import threading
from typing import NamedTuple

import torch

from deferinit.fake.bypass import no_python_dispatch
from deferinit.fake.flat import unflatten
from deferinit.fake.opinfo import bind

from ..ir.effects import contiguous
from ..ir.graph import Input
from .mt19937 import EXTEND_BELOW, advance, jump_is_cheap, normal_cache, without_normal_cache
from .rng import get_state, set_state


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


def _words_each(words_of: dict, family: str):  # words_of[dtype] words per element
    def count(sizes, strides, dtype) -> Consumption | None:
        w = words_of.get(dtype)
        if w is None:
            return None
        return Consumption(_numel(sizes) * w, layout=("each", w) if contiguous(sizes, strides) else None, family=family)
    return count


_uniform = _words_each(_FLOATS, "uniform")


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


_random_full = _words_each(_FULL_RANGE, "random")


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


def consumption(node) -> Consumption | None:
    """What random ``node`` takes from a CPU generator, or None when that is not
    known exactly.  Replay relies on it only once its family passed
    :func:`verified` (see :func:`checked`)."""
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


# -- skipping draws ----------------------------------------------------------

# Debts from EXTEND_BELOW words up to DRAW_BELOW are drawn (below, advance
# computes the words without a kernel; above, jumped: drawing costs ~3 ns a
# word, a jump ~50 ms, or ~3 ms when its polynomial is cached, as for the
# repeated gaps between a sharded rank's rows); into 1M words of scratch at
# a time.
DRAW_BELOW = 1 << 22
DRAW_BELOW_CACHED = 1 << 20
_CHUNK = 1 << 20


class Cursor:
    """A private CPU generator, exact up to ``owed`` words not drawn yet (and a
    cached normal sample used up, if ``drop_normal``).  Short debts are paid
    by drawing into scratch, long ones by a jump.  A skipped per-element
    normal draw that leaves its second Box-Muller sample in the generator
    has its last pair drawn for real (4 words): that puts eager's sample
    there."""

    __slots__ = ("generator", "owed", "drop_normal")

    def __init__(self, generator: torch.Generator):
        self.generator = generator
        self.owed = 0
        self.drop_normal = False

    def reset(self, state: torch.Tensor) -> None:
        """The generator is exactly ``state`` (what was owed no longer matters)."""
        set_state(self.generator, state)
        self.owed = 0
        self.drop_normal = False

    def skip(self, c: Consumption) -> None:
        """Move past a draw of consumption ``c`` without drawing it."""
        self.owed += c.words
        n = c.normals
        if not n:
            return
        if self._has_normal():
            n -= 1
            self.drop_normal = True
        pairs = -(-n // 2)
        if n % 2 == 0:
            self.owed += 4 * pairs
            return
        # The last pair's second sample stays in the generator: draw that pair.
        self.owed += 4 * (pairs - 1)
        self.settle()
        with no_python_dispatch():
            torch.empty(1, dtype=torch.float64).normal_(generator=self.generator)

    def _has_normal(self) -> bool:
        return not self.drop_normal and normal_cache(get_state(self.generator))

    def settle(self) -> torch.Tensor:
        """Pay what is owed; returns the generator's exact state."""
        if not self.owed and not self.drop_normal:
            return get_state(self.generator)
        state = get_state(self.generator)
        if self.drop_normal:
            state = without_normal_cache(state)
            set_state(self.generator, state)
        owed, self.owed, self.drop_normal = self.owed, 0, False
        if EXTEND_BELOW <= owed < (DRAW_BELOW_CACHED if jump_is_cheap(state, owed) else DRAW_BELOW) and verified("random"):
            _draw_words(self.generator, owed)
            return get_state(self.generator)
        state = advance(state, owed)
        set_state(self.generator, state)
        return state


def _draw_words(gen: torch.Generator, words: int) -> None:
    """Draw ``words`` words from ``gen`` into scratch (int32 ``random_()``: one word
    each, as the "random" family's check confirms before this is used)."""
    if not words:
        return
    with no_python_dispatch():
        scratch = torch.empty(min(words, _CHUNK), dtype=torch.int32)
        while words:
            n = min(words, _CHUNK)
            scratch[:n].random_(generator=gen)
            words -= n


# -- drawing part of a tensor -------------------------------------------------


def part_pieces(c: Consumption, numel: int, lo: int, hi: int):
    """``[(first word, start, stop)]``: the kernel calls that fill elements
    ``[lo, hi)`` of a tensor of ``numel`` elements as the whole draw would
    (each one on elements ``[start, stop)``, from its first word), or None
    when the layout does not allow it."""
    layout = c.layout
    if layout is None or not 0 <= lo < hi <= numel:
        return None
    if layout[0] == "each":
        w = layout[1]
        return [(lo * w, lo, hi)]
    if layout[0] != "blocks":
        return None
    _, w, tail_at = layout
    pieces = []
    q, r = divmod(numel, 16)
    blocks_end = numel - 16 if r else numel  # elements before it come from their own block
    if lo < blocks_end:
        start = lo - lo % 16
        stop = min(-(-min(hi, blocks_end) // 16) * 16, 16 * q)
        if stop - start < 16:
            return None
        pieces.append((start * w, start, stop))
    if r and hi > numel - 16:
        pieces.append((tail_at, numel - 16, numel))
    return pieces


def draw_part(cursor: Cursor, c: Consumption, flat: torch.Tensor, lo: int, hi: int, fill) -> bool:
    """Fill elements ``[lo, hi)`` of ``flat`` (a 1-d contiguous view of the whole
    tensor) as a draw of consumption ``c`` from the cursor's state would, calling
    ``fill(view)`` (the kernel with the recorded arguments) on pieces of it;
    the cursor ends where the whole draw ends.  False (nothing drawn) when
    the layout does not allow it."""
    pieces = part_pieces(c, flat.numel(), lo, hi)
    if pieces is None:
        return False
    at = 0
    for first, start, stop in pieces:
        cursor.owed += first - at
        cursor.settle()
        fill(flat[start:stop])
        w = c.layout[1]
        at = first + (stop - start) * w
    cursor.owed += c.words - at
    return True


# -- checked against the real kernels ----------------------------------------

#: The kernel families :func:`verified` checks.
FAMILIES = ("uniform", "normal", "log_normal", "random", "randperm", "bernoulli", "exponential", "geometric", "cauchy")

_verified: dict = {}
# Reentrant: a family's check settles debts, and settling draws long ones with
# int32 random_ only once the "random" family is verified, which may be
# checked from inside another family's check (a plain Lock deadlocked there).
_verify_lock = threading.RLock()


def verified(family: str) -> bool:
    """Whether the counts of ``family`` agree with this process's torch and CPU
    (checked on first use against the real kernels: :func:`check_family`).

    Example::

        >>> verified("uniform")
        True
    """
    if not family:
        return False
    found = _verified.get(family)
    if found is None:
        with _verify_lock:
            found = _verified.get(family)
            if found is None:
                # Until its own check ends, a family counts as unverified
                # (so a check reaching back to it jumps rather than recursing).
                _verified[family] = False
                # (Another thread reading it meanwhile generates: still exact.)
                try:
                    found = check_family(family)
                except BaseException:
                    del _verified[family]  # interrupted: checked again next time
                    raise
                _verified[family] = found
    return found


def checked(node) -> Consumption | None:
    """What random ``node`` takes from a CPU generator, when that is known exactly
    and its family passed :func:`verified`; else None (it is generated).

    Example::

        >>> m = deferred_init(torch.nn.Linear, 4, 3)
        >>> checked(m.weight._storage.head).words     # the uniform_ of reset_parameters
        12
    """
    found = consumption(node)
    if found is None or not verified(found.family):
        return None
    return found

_SIZES = (0, 1, 2, 3, 15, 16, 17, 31, 32, 33, 100, 4099, 65536 + 17)
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _geometry(t):
    return tuple(t.shape), tuple(t.stride()), t.dtype


def _tensors(dtype, sizes=_SIZES):
    """Tensors to probe: contiguous of each size, and a transposed one."""
    for n in sizes:
        yield torch.empty(n, dtype=dtype)
    yield torch.empty(8, 5, dtype=dtype).t()
    yield torch.empty(40, 3, dtype=dtype)[:, 1]


def _probes(family):
    """``(fill(tensor, generator), consumption(tensor))`` pairs for ``family``."""
    if family == "uniform":
        for dtype in _DTYPES:
            for t in _tensors(dtype):
                yield t, (lambda x, g: x.uniform_(-2.0, 3.0, generator=g)), _uniform(*_geometry(t))
    elif family == "normal":
        for dtype in _DTYPES:
            for t in _tensors(dtype):
                yield t, (lambda x, g: x.normal_(0.5, 2.0, generator=g)), _normal(*_geometry(t))
    elif family == "log_normal":
        for dtype in _DTYPES:
            for t in _tensors(dtype, (0, 1, 2, 3, 17, 100)):
                yield t, (lambda x, g: x.log_normal_(generator=g)), Consumption(0, normals=t.numel())
    elif family == "random":
        for dtype in (torch.int64, torch.int32, torch.uint8, torch.bool, *_DTYPES):
            for t in _tensors(dtype, (0, 1, 17, 4099)):
                yield t, (lambda x, g: x.random_(generator=g)), _random_full(*_geometry(t))
                if dtype is not torch.bool:
                    yield t, (lambda x, g: x.random_(3, 100, generator=g)), _random_range(*_geometry(t), 97)
                    yield t, (lambda x, g: x.random_(7, generator=g)), _random_range(*_geometry(t), 7)
    elif family == "randperm":
        for n in (0, 1, 2, 3, 10, 4099):
            for dtype in (torch.int64, torch.int32):
                yield None, (lambda x, g, n=n, dtype=dtype: torch.randperm(n, dtype=dtype, generator=g)), Consumption(max(n - 1, 0))
    elif family in ("bernoulli", "exponential", "geometric", "cauchy"):
        calls = {
            "bernoulli": lambda x, g: x.bernoulli_(0.3, generator=g),
            "exponential": lambda x, g: x.exponential_(generator=g),
            "geometric": lambda x, g: x.geometric_(0.3, generator=g),
            "cauchy": lambda x, g: x.cauchy_(generator=g),
        }
        for dtype in _DTYPES:
            for t in _tensors(dtype, (0, 1, 17, 4099, 65536 + 17)):
                yield t, calls[family], _two_words(family)(*_geometry(t), {})


def check_family(family: str) -> bool:
    """Whether the counts (and parts) of ``family`` agree with the real kernels here."""
    found = False
    with no_python_dispatch():
        for t, fill, c in _probes(family):
            found = True
            if c is None:
                continue
            # Mid-block and across a refill, with a cached normal sample or
            # none; parts once.  The big sizes once: they only look for
            # another path above some size.
            big = t is not None and t.numel() > 4096
            for warm, cached, parts in ((700, False, True), (5, True, False))[: 1 if big else 2]:
                if not _agrees(t, fill, c, warm, cached, parts):
                    return False
    return found


def _agrees(t, fill, c, warm: int, cached: bool, parts: bool) -> bool:
    g = torch.Generator().manual_seed(1234 + warm)
    torch.rand(warm, generator=g)
    if cached:
        torch.empty(1, dtype=torch.float64).normal_(generator=g)  # leaves a cached normal sample
    start = get_state(g)
    real = fill(t, g)
    expected = get_state(g)
    mine = torch.Generator()
    cursor = Cursor(mine)
    cursor.reset(start)
    cursor.skip(c)
    if not _same(cursor.settle(), expected):
        return False
    if not parts or c.layout is None or t is None or t.numel() < 2 or not t.is_contiguous():
        return True
    # Parts: a shard's rows, the head, the tail, one element, across blocks.
    n = t.numel()
    whole = real  # t itself, untouched until the next probe
    for lo, hi in {(0, 1), (n // 3, 2 * n // 3), (n - 1, n), (max(n - 18, 0), n), (0, n), (1, max(n - 17, 2))}:
        if not 0 <= lo < hi <= n:
            continue
        out = torch.empty_like(t)
        cursor.reset(start)
        if not draw_part(cursor, c, out.view(-1), lo, hi, lambda v: fill(v, cursor.generator)):
            continue
        if not _same(out.view(-1)[lo:hi], whole.view(-1)[lo:hi]):
            return False
        if not _same(cursor.settle(), expected):
            return False
    return True


def _same(a, b) -> bool:
    """Bitwise equality (NaNs and all), without torch's thread pool."""
    return a.contiguous().view(torch.uint8).numpy().tobytes() == b.contiguous().view(torch.uint8).numpy().tobytes()
