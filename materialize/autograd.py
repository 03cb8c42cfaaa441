"""Eager's autograd graph for tensors computed from parameters.

``self.register_buffer("w2", self.w * 2)`` gives, eagerly, a tensor that is
not a leaf: its ``grad_fn`` leads to ``w``, and ``backward()`` puts the
gradient on ``w``.  The fakes know this (autograd runs above the Fake layer,
so a fake has the ``grad_fn`` its eager twin has), and the record knows
which calls autograd saw and which leaf objects they read
(``Node.grad``, :class:`deferinit.graph.Leaf`).  Replay runs those calls
with grad enabled on the very leaf objects that will be swapped into the
fakes (:class:`Binder` makes them, dressed, when first read), so the real
tensor gets the same graph on the same leaves.  :func:`check_graph` then
compares the real graph with the fake one, node by node, before anything is
swapped in: what cannot match raises :class:`AutogradMaterializationError`.
"""

from __future__ import annotations

import torch

from deferinit.errors import AutogradMaterializationError
from deferinit.recorder import is_deferred_fake
from fake.tensor import FakeTensor


def leaf_token(t: torch.Tensor):
    """The :class:`deferinit.graph.Leaf` of a fake leaf (None if autograd never read it)."""
    return t.__dict__.get("_leaf") if isinstance(t, FakeTensor) else None


def grad_fn_of(t: torch.Tensor):
    """``t.grad_fn``, or None where reading it raises: a view taken under
    ``no_grad`` whose base was written in place since (eagerly too), or a
    view of a view of a fake after an in-place op on the base (see
    docs/errors.md's known differences)."""
    try:
        return t.grad_fn
    except RuntimeError:
        return None


def _raises_grad_fn(t: torch.Tensor) -> bool:
    try:
        t.grad_fn
    except RuntimeError:
        return True
    return False


def view_again(t: torch.Tensor, fake: torch.Tensor | None = None) -> torch.Tensor:
    """``t``, or the same view of the same base taken again under ``no_grad``
    where replay's writes made reading its ``grad_fn`` raise and eager's does
    not (``fake`` says so; without it, eager read it without error).

    A view taken under ``no_grad`` shares its base's version counter, and
    autograd refuses to read the ``grad_fn`` of such a view once that
    counter has moved.  Eagerly a write through ``t.data`` (a version counter
    of its own) moves nothing; replay writes the memory through whichever
    tensor holds the value, and does.  Taken again, the view starts from the
    counter as it is: what eager's view is, bar the counter's number.  It is
    taken empty and then pointed at ``t``'s memory: the base's may have been
    replaced since (``p.data = ...``), as eagerly, and the counter is put
    back where ``set_`` moved it, for the base and its other views.
    """
    if not t._is_view() or t._base is None or t.dtype != t._base.dtype:
        return t
    if torch._C._autograd._get_creation_meta(t) != _NO_GRAD_MODE or not _raises_grad_fn(t):
        return t
    if fake is not None and _raises_grad_fn(fake):
        return t  # eagerly too
    with torch.no_grad():
        out = t._base.as_strided((0,), (1,), 0)
        version = out._version
        out.set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())
    torch._C._autograd._unsafe_set_version_counter((out,), (version,))
    return out


_NO_GRAD_MODE = torch._C._autograd.CreationMeta.NO_GRAD_MODE


def is_grad_view(t: torch.Tensor) -> bool:
    """A view requiring grad without a graph of its own: taken under
    ``no_grad`` from a tensor that requires grad (eagerly it stays a view of
    that tensor, and requires grad)."""
    return (
        t.requires_grad
        and not t.__dict__.get("_is_param")
        and grad_fn_of(t) is None
        and t._is_view()
        and t._base.requires_grad
    )


def needs_graph(fake: torch.Tensor) -> bool:
    """Whether eager's ``fake`` belongs to an autograd graph that replay must rebuild."""
    return not fake.is_inference() and (grad_fn_of(fake) is not None or is_grad_view(fake))


def graph_leaves(t: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors gradients of ``t`` accumulate into (its ``AccumulateGrad`` nodes).

    Example::

        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> [x is w for x in graph_leaves(w * 2)]
        [True]
    """
    leaves, seen = [], set()
    stack = [grad_fn_of(t)]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        variable = getattr(fn, "variable", None)
        if isinstance(variable, torch.Tensor) and all(v is not variable for v in leaves):
            leaves.append(variable)
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return leaves


def deferred_leaves(targets) -> list[tuple[str, torch.Tensor]]:
    """``(label, fake)`` for what the graphs of ``targets`` reach that is still
    deferred and not a target: their leaves, and the base of a view (eagerly
    the view's ``_base``).  They must be materialized along."""
    ids = {id(f) for _, f in targets}
    extra = []
    work = list(targets)
    while work:
        name, fake = work.pop()
        if not needs_graph(fake):
            continue
        roots = [fake]
        if fake._is_view() and fake._base is not None:
            base = fake._base
            roots.append(base)
            storage = base.__dict__.get("_storage")
            if (needs_graph(base) and is_deferred_fake(base) and id(base) not in ids
                    and storage is not None and storage.real is None):
                ids.add(id(base))
                extra.append((f"{name} (its base)", base))
                work.append(extra[-1])
        leaves = []
        for root in roots:
            if root.requires_grad and grad_fn_of(root) is None and not is_grad_view(root):
                leaves.append(root)
            leaves.extend(graph_leaves(root))
        for leaf in leaves:
            token = leaf_token(leaf)
            if token is not None and token.real is not None:
                # Materialized already: the graph of fakes still holds the
                # fake's old tensor, which looks deferred but is not needed.
                continue
            if is_deferred_fake(leaf) and id(leaf) not in ids:
                ids.add(id(leaf))
                extra.append((f"{name} (its autograd leaf)", leaf))
    return extra


class Binder:
    """Hands replay the leaf object to compute on when a node autograd recorded
    reads a leaf: the target's own object (made once, by ``make(fake, tensor)``,
    and swapped into the fake afterwards), or the real object of a leaf
    materialized earlier.  Any other leaf gets an object of its own: no graph
    of a target accumulates into it (:func:`deferred_leaves` made every leaf
    they reach a target), it only makes what is computed from it require
    grad, as eagerly."""

    def __init__(self, targets, make):
        self.fakes = {}
        for _, fake in targets:
            token = leaf_token(fake)
            if token is not None:
                self.fakes[id(token)] = fake
        self.make = make
        self.made: dict = {}  # id(Leaf) -> leaf object made in this replay
        # Targets that belong to a graph: one whose memory is already real
        # (a view of a parameter materialized before) is viewed again from
        # the real parameter (Replay._view_again).
        self.views_again = [i for i, (_, fake) in enumerate(targets) if needs_graph(fake)]

    def __call__(self, token, tensor: torch.Tensor, inp) -> torch.Tensor:
        real = token.real
        if real is not None and same_memory(real, tensor):
            # Materialized before, and this is its memory (a read of a
            # storage already real, or a view node taken again from it),
            # even where an older version of it, computed afresh, got an
            # object of its own below.
            return real
        obj = self.made.get(id(token))
        if obj is not None:
            if not same_memory(obj, tensor):
                # The leaf's data was replaced since autograd last read it
                # (``t.data = ...``): eagerly the same object, other memory.
                with torch.no_grad():
                    obj.data = tensor
            return obj
        fake = self.fakes.get(id(token))
        if fake is not None:
            obj = self.made[id(token)] = self.make(fake, tensor)
            if not obj.requires_grad:
                # It required grad when autograd read it (requires_grad_(False)
                # came later, and is applied after the replay, as eagerly).
                obj.requires_grad_(True)
            return obj
        # A leaf no target's graph accumulates into (a temporary parameter
        # only viewed under no_grad): a leaf of its own, that nothing sees.
        obj = self.made[id(token)] = tensor.detach().requires_grad_(True)
        return obj

    def made_for(self, fake):
        token = leaf_token(fake)
        return self.made.get(id(token)) if token is not None else None

    def corresponds(self, fake_leaf, real_leaf) -> bool:
        """Whether ``real_leaf`` is what ``fake_leaf`` becomes (or already is)."""
        if real_leaf is fake_leaf:
            return True
        token = leaf_token(fake_leaf)
        if token is None:
            return False
        return real_leaf is self.made.get(id(token)) or real_leaf is token.real


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.storage_offset() == b.storage_offset()
        and a.dtype == b.dtype
    )


def check_graph(name: str, fake: torch.Tensor, real: torch.Tensor, binder: Binder | None) -> None:
    """Raise :class:`AutogradMaterializationError` unless ``real``'s autograd graph
    is ``fake``'s: the same nodes, edges and leaves."""
    if fake.is_inference():
        return
    if is_grad_view(fake):
        # Rebuilt as a view of its base when replay could (dress falls back
        # to a leaf that requires grad: docs/errors.md, known differences).
        return
    if grad_fn_of(fake) is None:
        return
    stack = [(grad_fn_of(fake), grad_fn_of(real))]
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
