"""What autograd saw of a recorded call, kept on its node for replay.

Replay recomputes eager's autograd graph (materialize/autograd.py) from
facts recorded per call: which inputs were leaves requiring grad (shared
:class:`~deferinit.ir.graph.Leaf` markers, so that one leaf read by several calls
is one tensor again) and which were fakes not requiring grad (``t.data``);
for views, the base object and its version counter; for writes, which
tensors written required no grad or were ``t.data``.  Also the
``requires_grad_`` calls on leaves (a view follows its base's flag) and
``t.data =`` on a tensor with a graph (:func:`data_node`).
"""

from __future__ import annotations

import torch

from deferinit.fake.flat import flatten
from deferinit.fake.tensor import FakeTensor

from .ir.graph import Input, Leaf, Node

_SET = torch.ops.aten.set_.source_Tensor
_grad_enabled = torch.is_grad_enabled


def _is_leaf(x: FakeTensor) -> bool:
    """A leaf requiring grad (a view taken under no_grad of a tensor requiring
    grad is not one: replay computes it from its base).

    The view test comes first: ``is_leaf`` of a view of a tensor requiring
    grad whose version moved makes autograd regenerate its ``grad_fn``, and
    here, inside ``__torch_dispatch__`` (below autograd), that would replay
    the view functions without autograd and leave the view no ``grad_fn``."""
    try:
        return not (x._is_view() and x._base.requires_grad) and x.is_leaf
    except RuntimeError:
        # Autograd refuses to rebuild this view's grad_fn (a view taken under
        # no_grad whose base was written in place under grad mode).
        return False


def note_autograd(node: Node, info, flat, args, kwargs) -> None:
    """Note on ``node`` what autograd saw of its call (see :class:`deferinit.ir.graph.AutogradFacts`)."""
    grad_mode = _grad_enabled()
    if info.view_arg is not None:
        # Autograd marks every view with the grad mode it was taken in
        # (an in-place op may later need it), and a view taken under
        # no_grad of a tensor that requires grad requires grad too.
        facts = node.own_autograd()
        facts.grad = autograd_reads(flat, view=True)
        facts.no_grad = not grad_mode
        base = info.arg(args, kwargs, info.view_arg)
        if isinstance(base, torch.Tensor) and not base.is_inference():  # inference: no version counter
            # The version the view starts from: autograd regenerates its
            # grad_fn once the version counter it shares moved on.
            facts.base_version = base._version
    elif grad_mode:
        grad = autograd_reads(flat)
        if grad is not None:
            facts = node.own_autograd()
            facts.grad = grad
            facts.read_versions = view_versions(flat)


def note_writes(node: Node, flat) -> None:
    """Note which of the tensors ``node`` writes (``node.writes``) required no
    grad, and which are ``t.data`` (a version counter of their own): replay
    writes through whichever tensor holds the value, which may require grad,
    or share a version counter with views whose ``grad_fn`` a write makes
    autograd regenerate, where this one does not."""
    data = tuple(i for i in node.writes if "_data_alias" in flat[i].__dict__)
    if data:
        node.own_autograd().data_writes = data
    plain = tuple(i for i in node.writes if not flat[i].requires_grad)
    if plain:
        node.own_autograd().plain_writes = plain


def note_set_with_grad(node: Node, fake: FakeTensor, pos: int) -> None:
    """``t.set_(source)`` that autograd saw (``source`` requires grad): ``t``
    gets a graph, which the views of ``t`` follow.  A view ``t`` gives its
    base the graph (``CopySlices``): the node is a write of the base's memory
    too, so that reads of the base replay it.  A ``t`` of its own that views
    were taken of (it has a ``Leaf``) is named by it, and requires grad from
    here on: replay takes those views, and runs this node, on one object."""
    if fake._is_view():
        fake._storage.head = node
        return
    leaf = fake.__dict__.get("_leaf")
    if leaf is not None and not fake.requires_grad:
        facts = node.own_autograd()
        facts.grad = tuple((p, leaf if p == pos else x) for p, x in facts.grad)
        leaf.changed(True)


def autograd_reads(flat, view: bool = False):
    """What autograd saw of this call: None if no input requires grad (and
    the call is no view), else ``(position, Leaf)`` for the inputs that are
    leaves requiring grad and ``(position, None)`` for the fakes that do not
    require grad (``t.data``: replay strips whatever graph its value has).

    The base of a view, when it is a tensor of its own (no view) that does
    not require grad now, is named by its ``Leaf`` too: the view's
    ``requires_grad`` follows that object's, and a ``requires_grad_`` on it
    may come later (see :meth:`deferinit.ir.graph.Leaf.changed`)."""
    entries = []
    requires = False
    for i, x in enumerate(flat):
        if not isinstance(x, torch.Tensor):
            continue
        if x.requires_grad:
            requires = True
            if isinstance(x, FakeTensor) and _is_leaf(x):
                entries.append((i, leaf_of(x, True)))
        elif isinstance(x, FakeTensor):
            entries.append((i, leaf_of(x, False) if view and not x._is_view() else None))
    return tuple(entries) if requires or view else None


def leaf_of(x: FakeTensor, requires_grad: bool) -> Leaf:
    """The fake's ``Leaf``, made on its first read (``requires_grad`` its flag then)."""
    d = x.__dict__
    leaf = d.get("_leaf")
    if leaf is None:
        leaf = d["_leaf"] = Leaf(requires_grad)
    return leaf


def requires_grad_changed(x: FakeTensor) -> None:
    """After ``requires_grad_`` on a recorded fake: the nodes recorded from now
    on see its new flag (only a fake autograd already read has a ``Leaf``;
    any other one is read with its flag as it then is)."""
    leaf = x.__dict__.get("_leaf")
    if leaf is not None:
        leaf.changed(x.requires_grad)


def view_versions(flat) -> tuple:
    """``(position, version)`` of the fake views a call autograd saw reads: a
    view's ``grad_fn`` is regenerated once its version moved on since it was
    taken (:attr:`deferinit.ir.graph.AutogradFacts.base_version`)."""
    return tuple(
        (i, x._version) for i, x in enumerate(flat)
        if isinstance(x, FakeTensor) and x._is_view() and not x.is_inference()
    )


def grad_fn_of(x: torch.Tensor):
    """``x.grad_fn``, or None where reading it raises: a view taken under
    ``no_grad`` whose base was written in place since (eagerly too), or a
    view of a view of a fake after an in-place op on the base (see
    docs/errors.md's known differences)."""
    try:
        return x.grad_fn
    except RuntimeError:
        return None


def data_node(old: Input, new: Input) -> Node:
    """``t.data = new`` on a tensor with an autograd graph: it keeps that graph
    (the ``grad_fn`` of its older value) with ``new``'s memory, dtype and
    geometry.  Recorded as a ``set_`` of ``t`` to ``new`` (what it does to
    memory), marked ``data_swap``: replay runs ``.data =`` on the tensor its
    older value computed, so both the graph and the memory are eager's."""
    node = Node("op", _SET, [old, new], _SET_SPEC)
    node.writes = (0,)
    node.reshapes = True
    node.own_autograd().data_swap = True
    return node


_SET_SPEC = flatten((None, None), {})[1]
