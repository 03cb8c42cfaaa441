"""The calls autograd saw eagerly, run so that replay builds eager's graph.

Replay runs everything under ``no_grad`` except the nodes autograd recorded
(``Node.autograd.grad``), when a materialization has graphs to rebuild: those run with
grad enabled on the leaf objects :class:`deferinit.materialize.autograd.Binder` hands
out.  What else such a call needs to be as it was eagerly:

* the tensors it reshapes or writes in place are the objects they were
  (the very tensor with its graph, or an alias that requires no grad);
* ``t.data = new`` on a tensor with a graph keeps that graph;
* a view of memory already real is taken again from the real leaf, with the
  ``requires_grad`` that leaf had when the call ran, and its ``grad_fn``
  regenerated where its base was written since, as autograd does.
"""

from __future__ import annotations

import torch

from deferinit.graph import Input, Node
from deferinit.plan import real_read
from deferinit.fake.flat import flatten_output, unflatten
from deferinit.fake.opinfo import op_info

from .autograd import real_root, regenerated, view_again

_alias = torch.ops.aten.alias.default
_detach = torch.ops.aten.detach.default
_get_creation_meta = torch._C._autograd._get_creation_meta
_set_creation_meta = torch._C._autograd._set_creation_meta


class GradCalls:
    """The part of :class:`deferinit.materialize.replay.Replay` that runs calls with autograd."""

    def _swap_data(self, node: Node, args: list, env) -> torch.Tensor:
        """``t.data = new`` (:func:`deferinit.grad.data_node`): with graphs to
        rebuild, on the tensor with ``t``'s graph, as eagerly; else an alias of
        ``new``, all that the value is."""
        t, new = args
        if self.autograd is None or not t.requires_grad:
            return _alias(new)
        key = node.flat[0].value.key
        if self._uses.get(key, 0) > 1 and key in env:
            # Other tensors hold the older value (t.detach() taken before):
            # they keep its memory, without this graph, as eagerly.
            env[key] = _detach(t)
        with torch.no_grad():
            t.data = new
        return t

    def _alias(self, node: Node, t: torch.Tensor, pos: int) -> torch.Tensor:
        if self.autograd is None:
            return _alias(t)
        # Under autograd the tensor must be what it was eagerly: the very
        # tensor when it has a graph or is a view (its grad_fn is kept, or
        # regenerated from the view after the in-place op) or, for a call
        # autograd saw, the tensor its views were taken from (set_ from a
        # tensor requiring grad gives it a graph, which they follow), else a
        # tensor of its own.
        plain = node.autograd.grad is not None and any(p == pos and leaf is None for p, leaf in node.autograd.grad)
        if (plain or pos in node.autograd.plain_writes) and t.requires_grad:
            # Eagerly another object on this value, one that requires no grad.
            return _detach(t)
        key = node.flat[pos].value.key
        alone = self._uses.get(key, 0) <= 1  # nothing reads the old value after this node
        if alone and ((t.requires_grad and not plain) or (node.autograd.grad is not None and (t._is_view() or not t.requires_grad))):
            return t
        if node.autograd.grad is not None or not (t.requires_grad or t._is_view()):
            # No autograd view where eagerly the tensor is none: an alias
            # taken under no_grad would refuse a later in-place op under grad
            # mode (``p.data.copy_(p)`` after ``p.t_()``), eagerly allowed.
            return _detach(t)
        out = _alias(t)
        if t._is_view():
            # The view it is eagerly, taken in the grad mode it was taken in.
            _set_creation_meta(out, _get_creation_meta(t))
        return out

    def _run_with_grad(self, node: Node, args: list, draws=None, env=None, real_views=None):
        stale: list = []
        lent = self.autograd.lent()
        flags = []
        try:
            a, k = self._bind(node, args, stale, env, real_views)
            for t in stale:
                flags.append((t, t.requires_grad))
                t.requires_grad_(not t.requires_grad)
            with torch.set_grad_enabled(not node.autograd.no_grad):
                out = draws.call(node, a, k) if node.rng is not None else node.target(*a, **k)
            if id(node) in self.autograd.regenerate:
                # A view whose base was written since it was taken eagerly:
                # autograd regenerated its grad_fn from the base (done while
                # a real base holds the value it had then).
                out = regenerated(out) if isinstance(out, torch.Tensor) else type(out)(regenerated(o) for o in out)
            return out
        finally:
            for t, flag in flags:
                t.requires_grad_(flag)
            self.autograd.give_back(lent)

    def _bind(self, node: Node, args: list, stale: list, env, real_views):
        """The arguments of a call autograd saw, as eagerly: its leaves bound to
        the leaf objects; ``stale`` gets the real leaves that required no grad
        yet when it ran."""
        bound = set()
        for pos, leaf in node.autograd.grad:
            bound.add(pos)
            if leaf is None:
                if args[pos].requires_grad:
                    # What t.data gives: no graph, a version counter of its own.
                    args[pos] = args[pos].data
            else:
                args[pos] = self.autograd(leaf, args[pos], node)
                if args[pos].requires_grad != leaf.flag_at(node.seq) and args[pos].is_leaf:
                    # A leaf materialized before, whose requires_grad changed
                    # since this call ran eagerly: it runs with the flag of then.
                    stale.append(args[pos])
        for pos, x in enumerate(node.flat):
            if pos in bound or type(x) is not Input:
                continue
            if env is not None and real_read(x) and aliases_with_grad(x.value.node):
                # A view of memory already real, read with its autograd
                # relation (it requires grad through its base): taken again.
                outs = self._run_again(x.value.node, env, real_views)
                if outs is not None:
                    args[pos] = outs[x.value.index]
                    versions = x.value.node.autograd.base_version, dict(node.autograd.read_versions).get(pos)
                    if None not in versions and versions[0] != versions[1]:
                        # Written since it was taken: autograd regenerated its grad_fn.
                        args[pos] = regenerated(args[pos])
            if not node.autograd.no_grad and args[pos].requires_grad:
                # Autograd reads its grad_fn here, eagerly without error.
                args[pos] = view_again(args[pos])
        return unflatten(args, node.spec)

    def _view_again(self, inp: Input, env, real_views, real: torch.Tensor, fake) -> torch.Tensor:
        """A target that is a view of memory already real, and belongs to an
        autograd graph: its view node (or the ``set_`` that made it share that
        memory) runs again on the real leaf objects."""
        node = inp.value.node
        if not real_read(inp) or not aliases_with_grad(node):
            return real
        outs = self._run_again(node, env, real_views)
        if outs is None:
            return real
        out = outs[inp.value.index]
        root = real_root(inp.value)
        if (node.autograd.base_version is not None and fake._version != node.autograd.base_version) or (
            root is not None and root.real_version is not None and root.real._version != root.real_version
        ):
            # Eagerly its base was written since it was taken (while deferred,
            # or since it is real): autograd regenerated its grad_fn from the base.
            out = regenerated(out)
        return out

    def _run_again(self, node: Node, env, real_views) -> list | None:
        """The outputs of ``node`` run again with grad, or None where an input is gone."""
        is_set = op_info(node.target).opname == "set_"
        bound = {pos for pos, leaf in node.autograd.grad if leaf is not None}
        plain = {pos for pos, leaf in node.autograd.grad if leaf is None}
        args = []
        for pos, x in enumerate(node.flat):
            if type(x) is Input:
                storage = x.value.storage
                if storage is not None and storage.real is not None:
                    # A view depends on the geometry, not on the version read.
                    x = Input(x.value, storage.real_head)
                    if pos not in bound and aliases_with_grad(x.value.node):
                        # A view of real memory read with its autograd
                        # relation (a view of a parameter taken under no_grad).
                        outs = self._run_again(x.value.node, env, real_views)
                        if outs is not None:
                            args.append(outs[x.value.index])
                            continue
                elif is_set and pos in plain and pos in node.writes:
                    # What set_ replaces: its values never matter, and no
                    # graph reaches it; a tensor of its own stands in.
                    args.append(torch.empty(0, dtype=x.value.dtype, device=self.device_map(x.value.device)))
                    continue
                elif x.value.key not in env:
                    return None
                x = self._resolve(x, env, real_views)
            args.append(x)
        out = self._run_with_grad(node, args)
        return [out] if isinstance(out, torch.Tensor) else flatten_output(out)[0]


def aliases_with_grad(node: Node) -> bool:
    """A view, or a ``set_`` from a tensor, that autograd saw eagerly."""
    if node.kind != "op" or node.autograd.grad is None or node.rng is not None:
        return False
    info = op_info(node.target)
    return info.view_arg is not None or info.opname == "set_"
