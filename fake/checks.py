"""The argument checks eager kernels make and meta kernels skip.

Meta kernels compute shapes; many do not validate arguments the way the CPU
and CUDA kernels do, so a call eager PyTorch rejects would be recorded and
fail only at materialization, and a constructor that catches the error would
take another branch than eagerly.  Three kinds of checks are therefore made
here, before the meta kernel, with eager's own kernels (their exception types
and messages are eager's):

- random operators (``uniform_`` bounds for the dtype, ``bernoulli_(p)``,
  ``exponential_(lambd)``, ``random_(from, to)``, ``randint``, a dtype the
  kernel lacks): the CPU kernel runs on a stand-in of at most one element with
  the same dtype and rank (empty if the tensor is), drawing from a private
  generator.  Their checks depend on the dtype and the scalars only.
- scalars stored into a tensor (``fill_``, ``full``, ``masked_fill_``,
  ``index_fill_``, ``clamp_``...: arguments named ``value``, ``fill_value``,
  ``min``, ``max``): converted to the output's dtype as the kernel does, so
  ``fill_(1000)`` on ``int8`` overflows here too.
- writes into a tensor with internal overlap (an ``expand``-ed tensor): the CPU
  kernel runs on stand-ins of the same geometry (:mod:`deferinit.fake.standin`), which
  raises where eager raises (``normal_``, ``add_``, ``copy_``) and not where
  it does not (``fill_``, ``zero_``).  Ops that change only a geometry in place
  (``as_strided_``, ``t_``, ``resize_``) write no elements and are not checked.

Checks on the *values* of tensor arguments (an index out of range, negative
probabilities for ``multinomial``) need the data and happen at
materialization.  Passing checks are cached per operator, argument dtypes
and shapes, and scalars.
"""

from __future__ import annotations

import threading

import torch

from .bypass import no_python_dispatch
from .flat import flatten, unflatten
from .extent import extent_of
from .standin import LIMIT_BYTES, standin_bytes

_CPU = torch.device("cpu")
_STORED = frozenset({"value", "fill_value", "min", "max"})
# Arguments a small stand-in call keeps meaningful: the tensors filled or
# read for their shape and dtype, sizes, scalars.  Operators with others
# (multinomial's num_samples, which is checked against a size) are left out.
_COMMON = frozenset({"self", "size", "generator", "dtype", "layout", "device", "pin_memory",
                     "memory_format", "requires_grad", "names"})
_RANDOM_ARGS = _COMMON | {"from", "to", "low", "high", "mean", "std", "p", "lambd", "median", "sigma", "n"}
_STORED_ARGS = _COMMON | _STORED | {"mask", "dim", "index", "wrap"}
_RANDPERM_MAX = 1 << 16

_local = threading.local()
_passed: dict = {}


def _generator() -> torch.Generator:
    g = getattr(_local, "generator", None)
    if g is None:
        g = _local.generator = torch.Generator()
    return g


def _on_cpu(x):
    # The stand-in calls run on the CPU with a generator of their own: the
    # user's devices and generators are neither needed nor touched.
    if isinstance(x, torch.Generator):
        return _generator()
    if isinstance(x, torch.device):
        return _CPU
    return x


class _Facts:
    """Whether an operator's checks are made on small stand-ins, and with which
    overload (one taking a generator, for a random one), once per overload."""

    __slots__ = ("func", "small", "call", "geometry_only")

    def __init__(self, func):
        self.func = func
        args = func._schema.arguments
        names = {a.name for a in args}
        random = torch.Tag.nondeterministic_seeded in func.tags
        stored = any(a.name in _STORED and str(a.type) in ("number", "Optional[number]") for a in args)
        self.small = (random and names <= _RANDOM_ARGS) or (stored and names <= _STORED_ARGS)
        self.call = func
        # t_(), as_strided_(), resize_(), set_(): their write is the tensor's
        # geometry, not its elements, and eager checks no overlap for them
        # (an as_strided_ stand-in would also lack the storage it moves into).
        self.geometry_only = torch.Tag.inplace_view in func.tags
        if random and "generator" not in names:
            # randn.default draws from the default generator: its checks run
            # through randn.generator, with a private one.
            self.call = _with_generator(func)
            self.small = self.small and self.call is not None


def _with_generator(func):
    name = func._overloadname
    candidates = (f"{name}_generator", "generator" if name == "default" else f"generator_with_{name}")
    for candidate in candidates:
        sibling = getattr(func.overloadpacket, candidate, None)
        if sibling is not None and any(a.name == "generator" and a.kwarg_only for a in sibling._schema.arguments):
            return sibling
    return None


# By id: an OpOverload hashes in Python (hash(self._op)), and operators live
# as long as the process (their packets keep them).
_facts: dict = {}


def _facts_of(func) -> _Facts:
    facts = _facts.get(id(func))
    if facts is None or facts.func is not func:
        facts = _facts[id(func)] = _Facts(func)
    return facts


def check_arguments(func, args, kwargs, written=()) -> None:
    """Raise what eager ``func(*args, **kwargs)`` raises for its arguments (see
    the module docstring).  ``args``/``kwargs`` hold fakes' shadows or other
    tensors with their geometry; ``written`` the tensors the op writes.

    Example::

        >>> int8 = torch.empty(3, dtype=torch.int8, device="meta")
        >>> check_arguments(torch.ops.aten.fill_.Scalar, (int8, 1000), {}, (int8,))
        Traceback (most recent call last):
        RuntimeError: value cannot be converted to type int8_t without overflow
    """
    facts = _facts_of(func)
    if facts.small:
        _check_small(func, facts, args, kwargs)
    for w in () if facts.geometry_only else written:
        if _overlaps(w):
            _check_overlap(func, args, kwargs)
            break


_fills_passed: set = set()


def check_fill(func, tensor: torch.Tensor, scalars: tuple, generator=None) -> None:
    """``check_arguments`` of an in-place fill ``tensor.func(*scalars)`` (what every
    ``nn.init`` function ends in), with one flat cache in front: a model
    records thousands of fills of a few kinds, and building the general key
    cost more than the rest of recording the fill.

    Example::

        >>> t = torch.empty(2, 2, device="meta")
        >>> check_fill(torch.ops.aten.uniform_.default, t, (1.0, 0.0))
        Traceback (most recent call last):
        RuntimeError: uniform_ expects to return a [from, to) range, but found from=1 > to=0
    """
    if not tensor.is_contiguous():
        check_arguments(func, (tensor, *scalars), {"generator": generator} if generator is not None else {}, (tensor,))
        return
    # Types too: 1, 1.0 and True are equal keys otherwise.
    key = (id(func), tensor.dtype, tensor.shape, generator is None, scalars, tuple(map(type, scalars)))
    if key in _fills_passed:
        return
    check_arguments(func, (tensor, *scalars), {"generator": generator} if generator is not None else {}, (tensor,))
    _fills_passed.add(key)


def _small_shape(t: torch.Tensor) -> tuple:
    # At most 2 per dimension: rank, emptiness and "one element" (a fast
    # path in some kernels) are kept.
    return tuple(min(n, 2) for n in t.shape)


_SCALAR_TYPES = frozenset({float, int, bool})


def _add_part(key: list, x) -> None:
    # Flat (kind, value) pairs: the key of every recorded fill, kept cheap.
    t = type(x)
    if t in _SCALAR_TYPES or x is None:
        key += (t, x)  # the type too: 1, 1.0 and True are equal keys otherwise
    elif isinstance(x, torch.Tensor):
        key += (x.dtype, x.shape)
    elif isinstance(x, (torch.Generator, torch.device)):
        key += (type(x), None)
    elif isinstance(x, list):
        key += (list, tuple(x))
    else:
        key += (t, x)


def _key(func, args, kwargs):
    key = [id(func)]
    for x in args:
        _add_part(key, x)
    for name, x in kwargs.items():
        key.append(name)
        _add_part(key, x)
    return tuple(key)


def _small(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() or t.is_complex():
        return torch.ones(_small_shape(t), dtype=t.dtype)  # a valid probability, rate, std
    return torch.zeros(_small_shape(t), dtype=t.dtype)  # a valid index, an empty mask


def _check_small(func, facts, args, kwargs) -> None:
    try:
        key = _key(func, args, kwargs)
        if key in _passed:
            return
    except TypeError:  # unhashable: check every time
        key = None
    flat, spec = flatten(args, kwargs)
    with no_python_dispatch():
        small = [_small(x) if isinstance(x, torch.Tensor) else _on_cpu(x) for x in flat]
        a, k = unflatten(small, spec)
        a, k = _shrink_sizes(func, list(a), dict(k))
        if a is None:
            return
        if torch.Tag.nondeterministic_seeded in func.tags and k.get("generator") is None:
            k["generator"] = _generator()  # never the default generator
        facts.call(*a, **k)
    if key is not None:
        _passed[key] = True


def _shrink_sizes(func, a, k):
    """Sizes cut to at most 2 per dimension (randperm's ``n`` is checked as is,
    up to 65536)."""
    for i, arg in enumerate(func._schema.arguments):
        positional = i < len(a) and not arg.kwarg_only
        value = a[i] if positional else k.get(arg.name)
        if value is None:
            continue
        if arg.name == "size":
            value = [min(int(n), 2) for n in value]
        elif arg.name == "n" and func._opname == "randperm":
            if value > _RANDPERM_MAX:
                return None, None
            continue
        else:
            continue
        if positional:
            a[i] = value
        else:
            k[arg.name] = value
    return a, k


def _overlaps(t) -> bool:
    if not isinstance(t, torch.Tensor) or t.is_contiguous():
        return False
    for n, s in zip(t.shape, t.stride()):
        if s == 0 and n > 1:
            return True
    return False


def _check_overlap(func, args, kwargs) -> None:
    random = torch.Tag.nondeterministic_seeded in func.tags
    call = _with_generator(func) if random and not any(a.name == "generator" for a in func._schema.arguments) else func
    if call is None or standin_bytes(args, kwargs) > LIMIT_BYTES:
        return
    flat, spec = flatten(args, kwargs)
    with no_python_dispatch():
        # Arguments sharing memory share their stand-in's memory too, so the
        # kernel sees eager's aliasing (copy_ of a tensor into itself is
        # allowed, overlapping with another argument is not).
        memory: dict = {}
        for x in flat:
            if isinstance(x, torch.Tensor):
                key = (x.untyped_storage()._cdata, x.dtype)
                memory[key] = max(memory.get(key, 0), extent_of(x))
        memory = {key: torch.zeros(n, dtype=key[1]) for key, n in memory.items()}
        real = []
        for x in flat:
            if isinstance(x, torch.Tensor):
                base = memory[(x.untyped_storage()._cdata, x.dtype)]
                x = base.as_strided(x.size(), x.stride(), x.storage_offset())
            real.append(_on_cpu(x))
        a, k = unflatten(real, spec)
        if random and k.get("generator") is None:
            k["generator"] = _generator()  # never the default generator
        call(*a, **k)
