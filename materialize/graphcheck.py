"""Comparing the autograd graph replay built with eager's, before the swap.

The fake holds eager's graph (autograd runs above the Fake layer); the real
tensor holds the replay's.  They match node by node, with the leaves the
replay bound (:class:`deferinit.materialize.autograd.Binder`), bar one difference
autograd itself makes: a view whose ``grad_fn`` was regenerated is one
``as_strided`` node for a plain tensor, a chain of view nodes for a fake.
"""

from __future__ import annotations

import torch

from .errors import AutogradMaterializationError
from .autograd import Binder, grad_fn_of


def check_graph(name: str, fake: torch.Tensor, real: torch.Tensor, binder: Binder | None) -> None:
    """Raise :class:`AutogradMaterializationError` unless ``real``'s autograd graph
    is ``fake``'s: the same nodes, edges and leaves."""
    if fake.is_inference():
        return
    grad_fn = grad_fn_of(fake)
    if grad_fn is None:
        # A leaf; or a view taken under no_grad (is_grad_view), rebuilt as
        # a view of its base when replay could (dress falls back to a leaf
        # that requires grad: docs/errors.md, known differences).
        return
    stack = [(grad_fn, grad_fn_of(real))]
    seen = set()
    while stack:
        f, r = stack.pop()
        if f is None and r is None:
            continue
        if f is None or r is None or not _same_node(f, r):
            _refuse(name, fake, f, r)
        if (id(f), id(r)) in seen:
            continue
        seen.add((id(f), id(r)))
        fv = getattr(f, "variable", None)
        if fv is not None:
            rv = getattr(r, "variable", None)
            if binder is None or not binder.corresponds(fv, rv):
                _refuse(name, fake, f, r)
        if f.name() != r.name():
            f = _view_chain(f, r)
        fn, rn = f.next_functions, r.next_functions
        if len(fn) != len(rn):
            _refuse(name, fake, f, r)
        stack.extend((a, b) for (a, _), (b, _) in zip(fn, rn))


def _same_node(f, r) -> bool:
    if f.name() == r.name():
        return True
    # After an in-place op on a view, autograd regenerates the view's grad_fn:
    # with the view's own function for a tensor subclass (the fake), with
    # as_strided for plain tensors (eagerly, and the replay).
    return r.name().startswith("AsStridedBackward") and len(f.next_functions) == 1


def _view_chain(f, r):
    """The last node of the chain of view nodes ``f`` starts, where ``r`` is the
    ``as_strided`` a plain tensor regenerates a view's grad_fn with: the fake
    regenerates it by replaying each view function from the base (a node
    per view, ``t()`` then ``unfold``), down to the same base."""
    base = r.next_functions[0][0] if len(r.next_functions) == 1 else None
    while len(f.next_functions) == 1 and _is_view_node(f):
        below = f.next_functions[0][0]
        if below is None or base is None or below.name() == base.name() or not _is_view_node(below):
            break
        f = below
    return f


_VIEW_NODES: set = set()


def _is_view_node(fn) -> bool:
    """Whether ``fn`` is the backward node of a view op (``UnfoldBackward0``)."""
    if not _VIEW_NODES:
        for schema in torch._C._jit_get_all_schemas():
            ret = schema.returns[0].alias_info if schema.returns else None
            if schema.name.startswith("aten::") and ret is not None and not ret.is_write:
                words = schema.name[6:].split("_")
                _VIEW_NODES.add("".join(w.capitalize() for w in words) + "Backward")
    return fn.name().rstrip("0123456789") in _VIEW_NODES


def _refuse(name, fake, f, r):
    got = "no graph" if r is None else r.name()
    eager = type(grad_fn_of(fake)).__name__ if f is not None else "a view taken under no_grad"
    raise AutogradMaterializationError(
        f"cannot materialize {name} with eager's autograd graph: eagerly it is computed from "
        f"tensors that require grad ({eager}, at {f.name() if f is not None else 'the view'}), "
        f"the replay gave {got}. This happens when the tensors of one graph are materialized "
        "separately (a tensor computed from another computed tensor that was materialized "
        "before it, or a tensor sharing its memory, such as nn.Parameter(t) or t.detach(), "
        "materialized before it): materialize them in one materialize_module call, or this "
        "one first. Nothing was changed."
    )
