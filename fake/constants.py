"""Known values: fakes whose value follows from Python numbers, shapes and
``arange`` keep the real value they would have.

Optimizers' step counters, learning-rate factors and transformers' checks
on position ids read such values (``.item()``, ``bool(...)``); kept, they
get eager PyTorch's answer and a planned step takes the real step's path
(docs/fake.md, "Known values").

The rule, applied to every operator the plain fake handler computes:

* when every tensor argument has a known value (a real CPU tensor, or a
  fake whose memory holds a known value) and the operator is deterministic
  (not random, not an ``empty*`` factory whose memory is uninitialised), it
  is also computed for real, on CPU, on those values; a fresh output of at
  most :data:`KNOWN_LIMIT_BYTES` bytes keeps its value (factories such as
  ``zeros``, ``full`` and ``arange`` have no tensor argument: they are known
  whatever their size up to that limit);
* any other operator that writes a tensor in place makes the value of that
  tensor's memory unknown.

The limit, ``DEFERINIT_KNOWN_LIMIT_BYTES`` (default 1 MiB, the int64
position ids of 16 sequences of 8192 tokens), bounds the real bytes kept
and the real computation on them.  The value belongs to the *memory*: it is
kept on the fake storage (:mod:`deferinit.fake.storage`) as real bytes, and
each fake reads it through its own size, strides and offset, so aliases
agree as real ones do.  Reading the value of anything else still raises
:class:`~deferinit.fake.errors.FakeDataAccessError`.

Example::

    >>> with fake_mode():
    ...     step = torch.tensor(0.0)
    ...     step += 1
    ...     positions = torch.arange(4096).unsqueeze(0)
    ...     weights = torch.randn(3)
    >>> step.item(), float(step * 2 + 1), bool((positions.diff() == 1).all())
    (1.0, 3.0, True)
    >>> weights.sum().item()
    Traceback (most recent call last):
    deferinit.fake.errors.FakeDataAccessError: item() needs the data of a fake tensor ...
"""

from __future__ import annotations

import os

import torch

from .bypass import no_python_dispatch
from .flat import flatten_output, unflatten
from .storage import storage_of

#: Fresh outputs of at most this many bytes keep their value.
KNOWN_LIMIT_BYTES = int(os.environ.get("DEFERINIT_KNOWN_LIMIT_BYTES", str(1 << 20)))

_KEY = "_constant"
_CPU = torch.device("cpu")
_untyped_storage = torch.Tensor.untyped_storage
_INPLACE_VIEW = torch.Tag.inplace_view
# Factories whose memory is uninitialised: their values are not known, eagerly either.
_UNINITIALISED = frozenset(
    {"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided"}
)


def _known(shadow: torch.Tensor):
    """The real bytes of ``shadow``'s memory, if its value is known."""
    storage = _untyped_storage(shadow)
    real = storage.__dict__.get(_KEY)
    if real is not None and real.nbytes() != storage.nbytes():
        # The memory was resized since (untyped_storage().resize_()): the new bytes are unknown.
        del storage.__dict__[_KEY]
        return None
    return real


def _view(real: torch.UntypedStorage, shadow: torch.Tensor) -> torch.Tensor:
    with no_python_dispatch():
        return torch.empty(0, dtype=shadow.dtype).set_(
            real, shadow.storage_offset(), shadow.shape, shadow.stride()
        )


def value_of(fake) -> torch.Tensor | None:
    """A real CPU tensor with the value of ``fake``, or None when it is not known.

    The result shares the kept bytes: writing it changes the value of ``fake``
    and of its aliases.
    """
    shadow = fake.__dict__["_shadow"]
    real = _known(shadow)
    return None if real is None else _view(real, shadow)


def _keep(shadow: torch.Tensor, value: torch.Tensor) -> None:
    """Give the memory of ``shadow`` the value ``value`` (laid out as ``shadow``)."""
    storage = storage_of(shadow)
    with no_python_dispatch():
        real = torch.empty(storage.nbytes(), dtype=torch.uint8).untyped_storage()
        _view(real, shadow).copy_(value)
    storage.__dict__[_KEY] = real


def forget(fake) -> None:
    """The value of ``fake``'s memory is no longer known (it was written by unknown data)."""
    storage = _untyped_storage(fake.__dict__["_shadow"])
    storage.__dict__.pop(_KEY, None)


def _real_args(flat, fake_type):
    """The real counterparts of flattened arguments, or None when one is unknown."""
    real = list(flat)
    for i, x in enumerate(flat):
        if isinstance(x, fake_type):
            value = value_of(x)
            if value is None:
                return None
            real[i] = value
        elif isinstance(x, torch.Tensor):
            if x.device.type != "cpu":
                return None  # meta has no values; other devices: not here
        elif type(x) is torch.device:
            real[i] = _CPU
    return real


def after(call, func, fake_type) -> None:
    """Keep, compute or forget the values touched by ``call`` (a :class:`deferinit.fake.dispatch.Call`)."""
    if call.device.type == "meta" or not (call.fresh or call.mutated):
        return
    info = call.info
    if _INPLACE_VIEW in func.tags:
        # t_(), set_(), resize_(): the bytes stay; _known() notices a grown storage.
        return
    if info.random or info.opname in _UNINITIALISED:
        _forget_all(call.mutated)
        return
    for _, fake in call.fresh:
        if fake.numel() * fake.element_size() > KNOWN_LIMIT_BYTES and _known(fake.__dict__["_shadow"]) is None:
            _forget_all(call.mutated)
            return
    real = _real_args(call.flat, fake_type)
    if real is None:
        _forget_all(call.mutated)
        return
    args, kwargs = unflatten(real, call.spec)
    try:
        with no_python_dispatch():
            result = func(*args, **kwargs)
    except Exception:
        # No CPU kernel for this dtype, or the like: the values are simply not known.
        _forget_all(call.mutated)
        return
    out_flat, _ = flatten_output(result)
    for pos, fake in call.fresh:
        shadow = fake.__dict__["_shadow"]
        value = out_flat[pos] if pos < len(out_flat) else None
        if _known(shadow) is not None:
            continue  # a view of a known memory: it reads the same bytes
        if isinstance(value, torch.Tensor) and value.shape == shadow.shape and value.dtype == shadow.dtype:
            _keep(shadow, value)
    mutated = {id(m) for m in call.mutated}
    for i, x in enumerate(call.flat):
        # An in-place write on the real values reached the kept bytes, unless
        # the kernel had to reallocate them (an out= of another size).
        if isinstance(x, fake_type) and id(x) in mutated:
            kept = _known(x.__dict__["_shadow"])
            if kept is not None and real[i].untyped_storage().data_ptr() != kept.data_ptr():
                forget(x)


def _forget_all(fakes) -> None:
    for fake in fakes:
        forget(fake)


def read(func, args, kwargs, fake_type):
    """``func`` (``item()``, ``torch.equal``...) computed on known values, or
    NotImplemented when one argument's value is unknown."""
    flat = list(args) + list(kwargs.values())
    real = []
    for x in flat:
        if isinstance(x, fake_type):
            value = value_of(x)
            if value is None:
                return NotImplemented
            x = value
        real.append(x)
    with no_python_dispatch():
        return func(*real[: len(args)], **dict(zip(kwargs, real[len(args):])))
