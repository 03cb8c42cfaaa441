"""The recorded graph: nodes, values, storages and reads.

The IR follows the lineage of PyTorch's first tracer (Node/Value, SSA,
multiple outputs, no reference cycles):

* a :class:`Node` is one recorded call (an ATen overload, a constant, an
  outside tensor, or an opaque Python initialiser);
* a :class:`Value` is one tensor output of a node: the node, the position of
  the output, and its geometry (a *view* of some storage);
* a :class:`Storage` is the memory a value and its views share, as it is at
  record time: it knows the last node that wrote it (its *head*);
* an :class:`Input` is a read of a value *at a version*: the head of its
  storage when the read happened.  Every write node reads the value it
  writes at the previous head, so the writes of a storage form a chain back
  to its creation, and a reader taken before a write never sees it.

Every reference points back in time: values hold their node, nodes hold the
inputs they read, storages hold their latest writer.  Nothing in the graph
holds a fake tensor or the record; a fake holds its value and storage, so
the graph dies with the last fake that needs it.
"""

from __future__ import annotations

import itertools
import weakref

import torch

_seq = itertools.count()
_events = itertools.count()


def peek_seq() -> int:
    """The sequence number the next node will get (none is taken): where a
    record's node numbers start (see :class:`deferinit.view.Graph`)."""
    return int(repr(_seq)[6:-1])  # "count(N)": read without taking N


def event_seq() -> tuple[int, int]:
    """When a generator event happens, on the nodes' clock without taking a
    number from it: ``(seq of the next node, event count)``; events compare
    among themselves as tuples, and with nodes by their first item."""
    return (peek_seq(), next(_events))


class AutogradFacts:
    """What autograd saw of one recorded call, noted by :mod:`deferinit.grad`:
    what replay needs to build eager's autograd graph on the same leaf
    objects (``materialize/autograd.py``, ``materialize/replay.py``).

    Every node reads :data:`NOTHING_SEEN` until a note gives it its own
    (:meth:`Node.own_autograd`); like the node's, the fields left at their
    default are class attributes.
    """

    # Not None when autograd saw this call eagerly (a view, or an input
    # requiring grad under grad mode): ``((position in flat, Leaf), ...)``
    # for the inputs that were leaves requiring grad, so that replay can
    # build the same autograd graph on the same leaf objects, and
    # ``(position, None)`` for inputs that did not require grad; ``no_grad``
    # when grad mode was off (a view of a parameter taken under no_grad).
    grad = None
    no_grad = False
    # For a view: its base's version counter when it was taken (autograd
    # regenerates a view's grad_fn once that counter moved on).
    base_version = None
    # For a call autograd saw: ``((position, version), ...)`` of the views
    # it read (their version counter then).
    read_versions = ()
    # Positions in ``flat`` of the inputs it writes that required no grad,
    # and of those it writes through ``t.data`` (a version counter of its own).
    plain_writes = ()
    data_writes = ()
    # ``t.data = new`` on a tensor with a graph (a ``set_`` node; see
    # :func:`deferinit.grad.data_node`).
    data_swap = False

    def __repr__(self) -> str:
        return f"<AutogradFacts {self.__dict__}>"


class _NothingSeen(AutogradFacts):
    def __setattr__(self, name, value):
        raise AttributeError("NOTHING_SEEN is shared by every node: note on node.own_autograd()")


NOTHING_SEEN = _NothingSeen()
"""The facts of a call autograd saw nothing of: every field at its default."""


class Node:
    """One recorded call.

    ``kind`` is ``"op"`` (an ATen overload in ``target``), ``"constant"``
    (``payload`` holds the value, by copy), ``"external"`` (``payload`` holds
    an outside tensor by reference and ``version`` its version counter),
    ``"opaque"`` (a Python initialiser re-run as a whole at replay) or
    ``"load"`` (a write of the tensor read in ``flat[0]`` with the checkpoint
    tensor in ``payload``; see :mod:`deferinit.materialize.checkpoint`).
    ``flat``/``spec`` are the flattened ``(args, kwargs)`` with
    :class:`Input` in place of tensors.  ``autograd`` is what autograd saw of
    the call (:class:`AutogradFacts`).  Analyses keep what they find in
    tables of their own, not on the node (see :mod:`deferinit.ir.liveness`).
    """

    # No __slots__: the fields most nodes leave at their default are class
    # attributes, so making a node (the hot path of recording) sets five.
    payload = None
    version = None
    # For an "external" node: the memory and geometry the outside tensor had
    # when recorded, ``(storage, dtype, offset, shape, stride, conj, neg)``; replay reads them
    # if the tensor was pointed at other memory since (``t.data = other``).
    memory = None
    # (weak reference to the record stream, index in that stream) for nodes
    # that draw random numbers, else None.
    rng = None
    # Weak reference to the storage a random node writes or makes: a draw
    # whose storage nobody holds any more was a temporary.
    rng_target = None
    # ``(sizes, strides, dtype)`` of the tensor a random factory makes (an
    # in-place draw's is its written input's): how many words it draws
    # depends on it (deferinit.random.jumps).
    filled = None
    # True for an operator recorded after deferred_init returned (a change of
    # the model, such as load_state_dict's copies): see effects.is_load.
    after_deferral = False
    # True when the node changes the geometry of a tensor in place
    # (t_(), resize_(), set_()): replay runs it on an alias.
    reshapes = False
    # Positions in ``flat`` of the inputs this node writes in place.
    writes = ()
    default_dtype = None
    # What autograd saw: NOTHING_SEEN (shared, never written) until a note
    # gives the node its own (own_autograd()).
    autograd = NOTHING_SEEN

    def __init__(self, kind, target, flat=(), spec=None, payload=None):
        self.seq = next(_seq)
        self.kind = kind
        self.target = target
        self.flat = flat
        self.spec = spec
        if payload is not None:
            self.payload = payload

    def own_autograd(self) -> "AutogradFacts":
        """This node's own :class:`AutogradFacts`, made on the first note (for the recorder)."""
        facts = self.__dict__.get("autograd")
        if facts is None:
            facts = self.autograd = AutogradFacts()
        return facts

    @property
    def name(self) -> str:
        if self.kind == "op":
            return str(self.target)
        if self.kind == "opaque":
            return getattr(self.target, "__qualname__", repr(self.target))
        return self.kind

    def __repr__(self) -> str:
        return f"<Node %{self.seq} {self.name}>"



class Storage:
    """The memory shared by a base tensor and its views, at record time.

    ``head`` is the last node that wrote it (None: untouched since its
    creation).  Once a tensor on it has been materialized, ``real`` holds the
    real untyped storage and ``real_head`` the head it reflects, so that
    views and bases materialized at different times share memory.
    ``shared``: ``share_memory_()`` was called on a tensor of it (its real
    memory is moved to shared memory when materialized).
    """

    __slots__ = ("head", "real", "real_head", "shared", "__weakref__")

    def __init__(self):
        self.head = None
        self.real = None
        self.real_head = None
        self.shared = False


class Value:
    """A tensor produced by a node: output ``index`` of ``node``, with its geometry."""

    __slots__ = ("node", "index", "size", "stride", "offset", "dtype", "device", "_storage", "__weakref__")

    def __init__(self, node: Node, index: int, fake: torch.Tensor, storage: Storage, device=None):
        self.node = node
        self.index = index
        # The shadow (a plain meta tensor) answers faster than the wrapper.
        geometry = fake.__dict__.get("_shadow", fake)
        self.size = tuple(geometry.shape)
        self.stride = geometry.stride()
        self.offset = geometry.storage_offset()
        self.dtype = geometry.dtype
        self.device = device if device is not None else fake.device
        # Weak: the storage holds its writers, which hold their inputs,
        # which hold this value.
        self._storage = weakref.ref(storage)

    @property
    def key(self):
        return (self.node, self.index)

    @property
    def storage(self) -> Storage | None:
        return self._storage()

    def same_geometry(self, t: torch.Tensor) -> bool:
        # The stride of a dimension of size 1 addresses nothing, and meta
        # kernels may choose another one than CPU kernels do (zeros_like of
        # a permuted tensor): ignore it, or a real tensor would never be
        # recognised as its value and later views would lose their aliasing.
        size = t.shape
        if self.size == size and self.stride == t.stride():  # the common case, at once
            return self.offset == t.storage_offset() and self.dtype == t.dtype
        size = tuple(size)
        return (
            self.size == size
            and all(a == b or n == 1 for a, b, n in zip(self.stride, t.stride(), size))
            and self.offset == t.storage_offset()
            and self.dtype == t.dtype
        )

    def __repr__(self) -> str:
        return f"<Value %{self.node.seq}.{self.index} {list(self.size)} {self.dtype} {self.device}>"


class Input:
    """A read of ``value`` when its storage's head was ``version``."""

    __slots__ = ("value", "version")

    def __init__(self, value: Value, version: Node | None):
        self.value = value
        self.version = version

    def __repr__(self) -> str:
        return f"<Input {self.value!r} @ {self.version!r}>"


class FreshRead(Input):
    """A read of a value computed afresh although its storage is real: the
    computation carries eager's autograd graph, which the real memory,
    materialized through another tensor, lacks."""

    __slots__ = ()


class Leaf:
    """The identity of one leaf tensor object as autograd saw it while
    recording: one that requires grad (an ``nn.Parameter``), or one a view
    was taken of (a view's ``requires_grad`` follows its base's, also when
    ``requires_grad_`` comes later).

    Several tensor objects may share one value (``nn.Parameter(t)`` and
    ``t``), but gradients accumulate on one object, and views follow one
    object: the fake keeps its ``Leaf`` (``__dict__["_leaf"]``) and the nodes
    that read it through autograd name it.  ``events`` says when its
    ``requires_grad`` changed: ``(seq, flag)``, from the node numbered
    ``seq`` on (the first entry, at -1, is the flag when it was first read).
    Once materialized, ``real`` is the real tensor object (the very object
    that was the fake), so graphs replayed later reach it.
    """

    __slots__ = ("real", "real_version", "events")

    def __init__(self, requires_grad: bool = True):
        self.real = None
        # ``real``'s version counter when it became real: writes since then
        # make autograd regenerate the grad_fn of its views.
        self.real_version = None
        self.events = [(-1, requires_grad)]

    def changed(self, requires_grad: bool) -> None:
        """``requires_grad_`` on the fake: the nodes recorded from now on see ``requires_grad``."""
        if self.events[-1][1] != requires_grad:
            self.events.append((peek_seq(), requires_grad))

    def flag_at(self, seq: int) -> bool:
        """``requires_grad`` when node ``seq`` ran eagerly."""
        flag = self.events[0][1]
        for when, value in self.events:
            if when > seq:
                break
            flag = value
        return flag

    def after(self, seq: int) -> list:
        """The changes made after node ``seq`` ran."""
        return [e for e in self.events if e[0] > seq]


def version_seq(version: Node | None) -> int:
    return -1 if version is None else version.seq
