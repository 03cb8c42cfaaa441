"""Eager's autograd graph for tensors computed from parameters.

``self.register_buffer("w2", self.w * 2)`` is, eagerly, no leaf: its
``grad_fn`` leads to ``w``.  Replay runs the calls autograd saw
(``Node.autograd.grad``) with grad enabled on the very leaf objects that
will be swapped into the fakes (:class:`Binder` makes them when first read),
so the real tensor gets eager's graph on the same leaves; a leaf's
``requires_grad`` changes are replayed at their place
(:meth:`Binder.advance`).  docs/design.md ("Autograd") has the whole story;
:mod:`deferinit.materialize.graphcheck` compares the graphs before the swap.
"""

from __future__ import annotations

import heapq
import itertools

import torch

from deferinit.grad import grad_fn_of
from deferinit.ir.graph import FreshRead, Input
from deferinit.ir.plan import real_read
from deferinit.recorder import is_deferred_fake
from deferinit.fake.opinfo import op_info
from deferinit.fake.tensor import FakeTensor


def leaf_token(t: torch.Tensor):
    """The :class:`deferinit.ir.graph.Leaf` of a fake leaf (None if autograd never read it)."""
    return t.__dict__.get("_leaf") if isinstance(t, FakeTensor) else None


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
_DEFAULT = torch._C._autograd.CreationMeta.DEFAULT


def regenerated(view: torch.Tensor) -> torch.Tensor:
    """``view`` as autograd leaves a view taken under grad mode once its base was
    written in place through another alias: its ``grad_fn`` regenerated from
    the base (``as_strided`` for plain tensors).  Taken afresh, the view would
    keep the ``grad_fn`` of its own view function instead; moving the shared
    version counter would make other views regenerate too."""
    base = view._base if view._is_view() else None
    if base is None or not base.requires_grad or base.dtype != view.dtype:
        return view
    if torch._C._autograd._get_creation_meta(view) != _DEFAULT:
        return view
    with torch.enable_grad():
        return base.as_strided(view.size(), view.stride(), view.storage_offset())


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


def real_root_of(fake):
    """:func:`real_root` of a fake that is a view (None for any other)."""
    return real_root(fake._value) if fake._is_view() else None


def real_root(value):
    """The ``Leaf`` of the real object a deferred view was taken from (through
    views of views), or None: the view follows that object's autograd state,
    which may have changed since it became real."""
    while True:
        node = value.node
        if node.autograd.grad is None or node.kind != "op" or op_info(node.target).view_arg is None:
            return None
        base = None
        for pos, leaf in node.autograd.grad:
            if leaf is not None and leaf.real is not None:
                return leaf
        for x in node.flat:
            if type(x) is Input:
                base = x
                break
        if base is None:
            return None
        value = base.value


def fresh_reads(targets, reads) -> list[tuple[int, FreshRead]]:
    """``(index, read)`` for the targets computed with autograd whose memory is
    already real (a tensor sharing it, ``nn.Parameter(t, requires_grad=False)``,
    was materialized before): their computation is replayed afresh for its
    graph, and the result gets the real memory (:func:`with_fresh_graphs`)."""
    out = []
    for i, ((_, fake), read) in enumerate(zip(targets, reads)):
        node = read.value.node
        if (grad_fn_of(fake) is not None and real_read(read) and node.kind == "op"
                and op_info(node.target).view_arg is None and op_info(node.target).opname != "set_"):
            out.append((i, FreshRead(read.value, read.version)))
    return out


def with_fresh_graphs(reals: list, fresh, count: int) -> list:
    """The first ``count`` results, those with a fresh read (:func:`fresh_reads`)
    being the computed tensor, with its graph, on the real memory (as
    ``t.data = real``: eagerly that object shares the memory)."""
    out = list(reals[:count])
    for k, (i, _) in enumerate(fresh):
        graph = reals[count + k]
        with torch.no_grad():
            graph.data = out[i]
        out[i] = graph
    return out


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
        self._changes: list = []  # (seq, n, object, flag): requires_grad_ still to apply
        self._lent: list = []  # (real leaf, its data) while it holds an older value
        self._order = itertools.count()
        # Targets that belong to a graph: one whose memory is already real
        # (a view of a parameter materialized before) is viewed again from
        # the real parameter (Replay._view_again).
        self.targets = [fake for _, fake in targets]
        # View nodes of targets whose grad_fn autograd regenerated eagerly
        # (their base was written since they were taken).
        self.regenerate = {
            id(fake._value.node) for fake in self.targets
            if fake._is_view() and fake._value.node.autograd.base_version is not None
            and fake._value.node.autograd.base_version != fake._version
        }
        self.views_again = [
            i for i, fake in enumerate(self.targets) if needs_graph(fake) or real_root_of(fake) is not None
        ]

    def __call__(self, token, tensor: torch.Tensor, node) -> torch.Tensor:
        """The object ``node`` reads as the leaf ``token`` (``tensor`` its value)."""
        seq = node.seq
        real = token.real
        if real is not None:
            if same_memory(real, tensor):
                # Materialized before, and this is its memory (a read of a
                # storage already real, or a view node taken again from it).
                return real
            # An older value of it, computed afresh: eagerly the same object
            # held it then, and holds it for this call (a view taken now
            # keeps that memory, and the real object as its base).
            self._lent.append((real, real.data))
            with torch.no_grad():
                real.data = tensor
            return real
        obj = self.made.get(id(token))
        if obj is not None:
            if not same_memory(obj, tensor):
                # The leaf's data was replaced since autograd last read it
                # (``t.data = ...``): eagerly the same object, other memory.
                with torch.no_grad():
                    obj.data = tensor
            return obj
        flag = token.flag_at(seq)
        later = token.after(seq)
        if not flag and not later:
            # The base of a view that never requires grad: no object to follow.
            return tensor.data if tensor.requires_grad else tensor
        fake = self.fakes.get(id(token))
        if fake is not None and flag:
            obj = self.make(fake, tensor)
        else:
            # A leaf no target's graph accumulates into (a temporary parameter
            # only viewed under no_grad), or the base of views that requires
            # no grad yet: an object of its own (dressed at the swap).
            obj = tensor.detach()
        if obj.requires_grad != flag:
            # Its flag when this node ran eagerly; later changes come in order.
            obj.requires_grad_(flag)
        self.made[id(token)] = obj
        for when, value in later:
            heapq.heappush(self._changes, (when, next(self._order), obj, value))
        return obj

    def lent(self) -> int:
        return len(self._lent)

    def give_back(self, mark: int) -> None:
        """After a call: the real leaves lent their older values since ``mark``
        (:meth:`lent`) get theirs back."""
        with torch.no_grad():
            while len(self._lent) > mark:
                real, data = self._lent.pop()
                real.data = data

    def advance(self, seq: float) -> None:
        """Apply the ``requires_grad_`` calls made eagerly before node ``seq``
        to the leaf objects made so far (a view follows its base's flag)."""
        changes = self._changes
        while changes and changes[0][0] <= seq:
            _, _, obj, value = heapq.heappop(changes)
            if obj.requires_grad != value:
                obj.requires_grad_(value)

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
