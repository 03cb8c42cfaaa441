"""Random operations on real tensors while a thread records, and running a random
operator from a given generator (replay uses that too).

A constructor may re-initialize tensors that are already real (a module
built eagerly and passed in, ``post_init``'s ``_init_weights``).  The draw
happens at once, on the real tensor, from a private generator in the state
eager would have at that point (as for ``get_rng_state`` while recording),
and joins the stream as a draw whose resulting state is known: the real
tensor holds eager's values when ``deferred_init`` returns.  No generator
anyone can see is written (except, for the instant of the call, the default
one for the rare operators that take no ``generator`` argument).

Example::

    >>> real = torch.nn.Linear(4, 4)
    >>> def build(head):
    ...     m = torch.nn.Sequential(torch.nn.Linear(4, 4), head)
    ...     for p in m.parameters():
    ...         torch.nn.init.normal_(p)   # the real head's too
    ...     return m
    >>> _ = torch.manual_seed(0); m = deferred_init(build, real)
    >>> is_deferred(m[0].weight), is_deferred(real.weight)   # real, with eager's values
    (True, False)
"""

from __future__ import annotations

import inspect

import torch

from deferinit.fake.bypass import no_python_dispatch
from deferinit.fake.flat import flatten

from ..ir.graph import Input, Node
from .record import FOREIGN
from .rng import default_generator, get_state, scratch_generator, set_state, stream_key


def draw_real(recorder, record, func, args, kwargs, info):
    """Run random operator ``func``, which writes real tensors, as eager would at
    this point of the record (see the module docstring); returns its result."""
    written = [t for t in info.written(args, kwargs) if isinstance(t, torch.Tensor)]
    flat, spec = flatten(args, kwargs)
    node_flat = list(flat)
    positions = []
    target_storage = None
    outside = []  # (tensor, external node) of the tensors written
    for i, x in enumerate(flat):
        if isinstance(x, torch.Tensor):
            # By reference, for a replay that needs this draw only for the
            # state it leaves (a device remap merging streams): the written
            # tensor then gets scratch memory of its geometry.
            value, storage = recorder._external_value(x, func)
            node_flat[i] = Input(value, None)
            if any(x is w for w in written):
                positions.append(i)
                target_storage = storage
                outside.append((x, value.node))
    node = Node("op", func, node_flat, spec)
    node.writes = tuple(positions)
    device = written[0].device
    key = stream_key(kwargs, device)
    stream = record.stream(key)
    record.observe(key)  # a seed this thread set since the last draw
    k = len(stream.nodes)
    gen = scratch_generator(device)
    set_state(gen, recorder.generator_state(stream, k))
    with no_python_dispatch():
        # Raising here (eager's argument checks) records nothing: eager drew nothing.
        out = call_with_generator(node, func, args, kwargs, gen, device)
    for x, external in outside:
        external.version = x._version  # this very write is not a change from outside
    # The storage is nobody's (it dies here): a replay treats the draw like a
    # random temporary, whose values nothing reads.
    record.add_random(node, key, target_storage)
    stream.post[k] = get_state(gen)
    return out


def call_with_generator(node, target, args, kwargs, gen: torch.Generator, device):
    """``target(*args, **kwargs)`` drawing from ``gen``, which is left in the state
    the call leaves.  Operators without a ``generator`` argument borrow the
    default generator of ``device`` for the call and give it back."""
    target, kwargs, takes = with_generator(node, kwargs, gen)
    if takes:
        return target(*args, **kwargs)
    real = default_generator(device)
    saved = get_state(real)
    # Logged: a thread recording meanwhile must not take the borrow for its own reseed.
    FOREIGN.set_state(real, get_state(gen))
    try:
        out = target(*args, **kwargs)
        set_state(gen, get_state(real))
    finally:
        FOREIGN.set_state(real, saved)
    return out


def with_generator(node, kwargs: dict, gen: torch.Generator):
    """``(callable, kwargs, takes)``: how to run ``node`` drawing from ``gen``;
    ``takes`` is False for operators that take no generator (they draw from
    the default one).

    Example::

        >>> node = Node("op", torch.ops.aten.randn.default)
        >>> with_generator(node, {}, torch.Generator())[0]
        <OpOverload(op='aten.randn', overload='generator')>
    """
    target = node.target
    if node.kind == "opaque":
        if "generator" in _parameters(target):
            return target, dict(kwargs, generator=gen), True
        return target, kwargs, False
    overload = _generator_overload(target)
    if overload is None:
        return target, kwargs, False
    return overload, dict(kwargs, generator=gen), True


_overloads: dict = {}


def _generator_overload(op):
    """``op`` if it takes ``generator=``, else its sibling overload that does
    (``aten.randn.default`` -> ``aten.randn.generator``), else None."""
    if op in _overloads:
        return _overloads[op]
    found = None
    if any(a.name == "generator" for a in op._schema.arguments):
        found = op
    else:
        packet = getattr(torch.ops.aten, op._opname, None) if op.namespace == "aten" else None
        name = op._overloadname
        parts = name.split("_")
        candidates = ["generator"] if name == "default" else [
            f"{name}_generator", "_".join(parts[:-1] + ["generator", parts[-1]]),
        ]
        original = [a.name for a in op._schema.arguments]
        for candidate in candidates:
            if packet is not None and candidate in packet.overloads():
                sibling = getattr(packet, candidate)
                names = [a.name for a in sibling._schema.arguments]
                if "generator" in names and [n for n in names if n != "generator"] == original:
                    found = sibling
                    break
    _overloads[op] = found
    return found


def _parameters(fn) -> tuple:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return ()
