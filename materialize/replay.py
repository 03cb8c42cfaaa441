"""The interpreter: replays the part of a record that some tensors need.

In the spirit of ``torch.fx.Interpreter``: one class, holding its plan
(:class:`deferinit.ir.plan.Plan` chose the nodes), one loop over the planned
nodes in recorded order, and ``run_node`` dispatching on how the plan runs
the node (``alloc``, ``direct``: see :mod:`deferinit.ir.liveness`) or else on
its kind (``op``, ``opaque``, ``external``, ``constant``, ``load``) to a
method of the same class; each value is freed at its last use.
Random nodes draw from the state their generator had eagerly, on private
generators (:mod:`deferinit.materialize.draws`; draws needed only for that
state are jumped over on CPU); the states later replays look up are cached
on the record, so any order of requests costs at most one extra pass.

Everything runs below autograd (``no_grad``, or ``inference_mode`` on request),
except, when ``autograd=`` is given, the calls autograd recorded eagerly:
those run with grad enabled on the leaf objects ``autograd`` hands out
(:class:`deferinit.materialize.autograd.Binder`), so that tensors computed
from parameters get eager's graph.  What else such a call needs to be as it
was eagerly:

* the tensors it reshapes or writes in place are the objects they were
  (the very tensor with its graph, or an alias that requires no grad);
* ``t.data = new`` on a tensor with a graph keeps that graph;
* a view of memory already real is taken again from the real leaf, with the
  ``requires_grad`` that leaf had when the call ran, and its ``grad_fn``
  regenerated where its base was written since, as autograd does.

What dead-work elimination marked runs otherwise than recorded: outputs
only *allocated* (their contents are all overwritten later), a random draw
replayed only for the *generator* (into scratch memory, or jumped over by
the collaborator :class:`deferinit.materialize.draws.Draws`), a ``copy_``
that reads a checkpoint *directly* into its destination.  Load nodes
(recorded by :func:`deferinit.materialize.load_checkpoint`) read their
checkpoint's bytes into the tensor, or only the parts read later.
"""

from __future__ import annotations

import torch

from deferinit.errors import MaterializationError, ReplayError
from deferinit.ir.graph import NOTHING_SEEN, Input, Node
from deferinit.ir.liveness import ALLOC, DIRECT, GENERATOR, RUN
from deferinit.ir.plan import Plan, real_read, read_of
from deferinit.random.streams import continues
from deferinit.fake.device import exists
from deferinit.fake.bypass import no_python_dispatch
from deferinit.fake.gradmode import below_autograd
from deferinit.fake.flat import flatten_output, unflatten
from deferinit.fake.opinfo import op_info
from deferinit.fake.tensor import describe

from .errors import DeviceUnavailableError, ExternalTensorMutatedError
from .autograd import real_root, regenerated, view_again
from .boxed import caller
from .draws import Draws
from .reuse import in_place_variant, reusable

__all__ = ["Replay", "read_of"]

_alias = torch.ops.aten.alias.default
_detach = torch.ops.aten.detach.default
_get_creation_meta = torch._C._autograd._get_creation_meta
_set_creation_meta = torch._C._autograd._set_creation_meta


class Replay:
    """One replay: the closure of some reads, executed in recorded order.

    Holds its :class:`~deferinit.ir.plan.Plan` (``plan``: the nodes, their
    modes, the random streams) and, while it runs, the values computed so
    far (``env``), the views of memory already real (``real_views``), the
    draws (``draws``, :class:`~deferinit.materialize.draws.Draws`) and the
    default dtype (``dtype_guard``).

    Example (what ``materialize_tensor`` does, minus the swap)::

        >>> m = deferred_init(torch.nn.Linear, 2, 3)
        >>> (w,) = Replay([read_of(m.weight)]).run()
        >>> type(w), w.shape
        (<class 'torch.Tensor'>, torch.Size([3, 2]))
    """

    def __init__(self, targets: list[Input], *, device=None, inference: bool = False, labels=None, progress=None, extra=(), autograd=None):
        if device is not None and torch.device(device).type == "meta":
            label = next((l for l in labels or () if l), "the tensors")
            raise ValueError(
                f"cannot materialize {label} on the meta device: meta tensors hold no values. "
                "Keep it deferred (it already reports shape, dtype and device), or use deferinit.fake.meta_like."
            )
        self.inference = inference
        # Targets taken again from real memory with their autograd relation.
        self.retaken: set = set()
        # autograd(leaf, tensor, input) -> the leaf object to compute on, for
        # the inputs of nodes autograd recorded (see materialize/autograd.py).
        self.autograd = autograd
        self.labels = labels or [None] * len(targets)
        self.progress = progress
        self.draw_stats: dict = {}
        # Eager's autograd graphs go through computations whose values later
        # writes overwrite (a load into a buffer computed from parameters
        # keeps the computation's grad_fn): with graphs to rebuild, nothing
        # is eliminated.
        self.plan = Plan(targets, device=device, extra=extra, eliminate=autograd is None)
        # How each node runs otherwise than recorded (plan.mode's table, asked once per node).
        self._modes = self.plan.liveness.modes if self.plan.liveness is not None else {}
        self.device_map = self.plan.device_map
        self._check_devices()

    def _check_devices(self) -> None:
        devices = {inp.value.device for inp in self.plan.targets}
        # A plan of the targets' own factory calls makes each on its target's
        # device: its device arguments are those.
        for node in self.plan.order if self.plan.whole is None else ():
            for x in node.flat:
                if type(x) is Input:
                    devices.add(x.value.device)
                elif type(x) is torch.device:  # a final class
                    devices.add(x)
            if node.kind == "constant":
                devices.add(node.target)
        for device in devices:
            mapped = self.device_map(device)
            if not exists(mapped):
                label = next((l for l in self.labels if l), "the tensor")
                raise DeviceUnavailableError(
                    f"cannot materialize {label} on {mapped}: this process has no such device "
                    f"(the record asks for {device}). Pass device='cpu' (or another device that "
                    "exists) to materialize elsewhere."
                )

    def _check_sources(self) -> None:
        """Before anything runs: every checkpoint the plan reads is still there, as
        recorded (so that a missing or changed file fails the replay at once)."""
        plan = self.plan
        seen = set()
        direct = plan.liveness.direct if plan.liveness is not None else {}
        for node in plan.order:
            load = node if node.kind == "load" else None
            if load is None and id(node) in direct:
                load = direct[id(node)][0]
            if load is not None and id(load.payload) not in seen:
                seen.add(id(load.payload))
                load.payload.check()

    # -- execution --------------------------------------------------------------

    def run(self, sink=None) -> list[torch.Tensor]:
        """Execute the plan; returns one real tensor per target read.

        ``sink(i, tensor)``: where the plan is only the targets' own factory
        calls (``Plan.whole``), target ``i`` is handed to it as soon as it is
        real (:meth:`_run_whole`); the results it takes (True) are None."""
        if sink is not None and self.plan.whole is not None and self.autograd is None:
            return self._run_whole(sink)
        self._check_sources()
        plan = self.plan
        reads = plan.reads
        uses: dict = {}
        wanted: dict[int, set] = {}
        # The recorded geometry of each output read (see materialize/reuse.py).
        self._produced = produced = {}
        # The loop's steps, worked out once: ``(node, keys, run, batch)``, the
        # keys of the values ``node`` reads from this replay (freed at their last
        # use), the method that runs it (run_node's choice), and ``batch``: the
        # nodes that follow it at once, in order: draws, each right after the
        # one before on one generator (Draws.follow: a random factory with its
        # recorded arguments, or a fill such as ``uniform_`` of a tensor), and
        # the allocations between them.  A model of many small
        # random tensors is mostly such runs.
        steps = []
        modes = self._modes
        liveness = plan.liveness
        scratch = liveness.scratch if liveness is not None else {}
        parts = liveness.parts if liveness is not None else {}
        streams = plan.streams
        run_node, draw = self.run_node, self.draw
        # The draws whose arguments are passed as recorded.
        self._as_recorded = as_recorded = set()
        # No device to map, no autograd leaf to hand out between nodes.
        runs = self.device_map.target is None and self.autograd is None
        no_keys = ()
        last = None  # (stream, index, default dtype, batch) of the draw that ends the last step's batch
        for node in plan.order:
            keys = no_keys
            run = run_node
            # Whether the last step's batch can take this node.
            open_batch = last is not None and steps[-1][3] is last[3]
            # plan.reads(node), without two calls per node.
            mode = modes.get(id(node))
            if mode is None:
                xs = [x for x in node.flat if type(x) is Input]
                if (node.rng is not None and node.kind == "op" and node.autograd is NOTHING_SEEN
                        and not node.reshapes and id(node) not in scratch and id(node) not in parts):
                    run = draw
                    if runs:
                        rs = streams[id(node.rng[0]())]
                        index = rs.index[id(node)]
                        dtype = node.default_dtype
                        follows = (open_batch and last[0] is rs and last[1] == index - 1 and last[2] is dtype
                                   and continues(rs, index))
                        batch = last[3] if follows else []
                        last = (rs, index, dtype, batch)
                        if not xs:
                            as_recorded.add(id(node))
                        else:
                            keys = [x.value.key for x in xs if not real_read(x)] or no_keys
                            for x in xs:
                                if not real_read(x):
                                    value = x.value
                                    uses[value.key] = uses.get(value.key, 0) + 1
                                    wanted.setdefault(id(value.node), set()).add(value.index)
                                    produced.setdefault(value.key, value)
                        if follows:
                            # A fill of one tensor (its first argument) is given it directly.
                            batch.append(node if not xs else (node, keys, len(keys) == len(xs) == 1 and node.flat[0] is xs[0]))
                        else:
                            steps.append((node, keys, run, batch))
                        continue
            elif mode == ALLOC:
                if open_batch and id(node) not in liveness.filled:
                    last[3].append((node, liveness.alloc[id(node)]))
                    continue
                xs = ()
            elif mode == DIRECT or mode == GENERATOR and id(node) in scratch:
                xs = reads(node)
            else:
                xs = [x for x in node.flat if type(x) is Input]
            last = None
            for x in xs:
                if not real_read(x):
                    value = x.value
                    key = value.key
                    if keys is no_keys:
                        keys = []
                    keys.append(key)
                    uses[key] = uses.get(key, 0) + 1
                    wanted.setdefault(id(key[0]), set()).add(key[1])
                    produced.setdefault(key, value)
            steps.append((node, keys, run, None))
        for inp in plan.targets:
            if not real_read(inp):
                value = inp.value
                node, index = key = (value.node, value.index)
                uses[key] = uses.get(key, 0) + 1_000_000_000  # never freed
                found = wanted.get(id(node))
                if found is None:
                    wanted[id(node)] = {index}
                else:
                    found.add(index)
                produced.setdefault(key, value)

        self.env = env = {}
        self.real_views = {}
        total = len(plan.order)
        self._uses = uses
        self._borrowed = set()  # ids of outside tensors, read by reference
        try:
            with Draws(plan.streams) as draws, no_python_dispatch(), below_autograd(self.inference), _DefaultDtype() as dtype_guard:
                self.draws, self.dtype_guard = draws, dtype_guard
                binder = self.autograd
                progress = self.progress
                done = 0
                for node, keys, run, batch in steps:
                    if binder is not None:
                        binder.advance(node.seq)
                    try:
                        run(node, wanted.get(id(node), ()))
                        if batch:
                            follow, keep, resolve = draws.follow, self._keep, self.resolve
                            for node in batch:
                                if type(node) is not tuple:  # a random factory
                                    keep(node, follow(node), wanted.get(id(node), ()))
                                    continue
                                if len(node) == 2:  # an allocation
                                    node, allocs = node
                                    _allocate(env, node, allocs, wanted.get(id(node), ()), self.device_map)
                                    continue
                                node, reading, first = node  # a fill
                                if first:
                                    flat = [env[reading[0]], *node.flat[1:]]
                                else:
                                    flat = [resolve(x) if type(x) is Input else x for x in node.flat]
                                keep(node, follow(node, flat), wanted.get(id(node), ()))
                                for key in reading:
                                    left = uses[key] - 1
                                    uses[key] = left
                                    if left == 0:
                                        env.pop(key, None)
                    except Exception as e:
                        raise self._failure(node, e) from e
                    for key in keys:
                        left = uses[key] - 1
                        uses[key] = left
                        if left == 0:
                            env.pop(key, None)
                    if progress is not None:
                        done += 1 + len(batch) if batch else 1
                        progress(done, total)
                self.draw_stats = draws.stats
                if binder is not None:
                    binder.advance(float("inf"))
                results = [self.resolve(inp) for inp in plan.targets]
                for i in getattr(self.autograd, "views_again", ()):
                    again = self._view_again(plan.targets[i], results[i], binder.targets[i])
                    if again is not results[i]:
                        if real_root(plan.targets[i].value) is not None:
                            # Taken from the real leaf it is a view of.
                            self.retaken.add(i)
                        results[i] = again
        finally:
            # The values die at the end of the run, as they did in its frame.
            self.env = self.real_views = self.draws = self.dtype_guard = None
        return results

    def _run_whole(self, sink) -> list:
        """:meth:`run` of a plan of the targets' own factory calls, one each: a
        target is final once its node ran, so it goes to ``sink`` at once
        (the pipeline dresses and swaps it in there: one pass per tensor,
        which a model of many small tensors needs).  Draws that take their
        generator right after the one before are :meth:`Draws.follow`'s."""
        plan = self.plan
        targets = plan.targets
        results = [None] * len(targets)
        self.env = env = {}
        self.real_views = {}
        self._produced, self._uses, self._borrowed, self._as_recorded = {}, {}, set(), set()
        # Arguments passed as recorded (no tensor among them) where no device is mapped.
        as_recorded = self.device_map.target is None
        streams = plan.streams
        progress = self.progress
        total = len(plan.order)
        node = None
        try:
            with Draws(streams) as draws, no_python_dispatch(), below_autograd(self.inference), _DefaultDtype() as dtype_guard:
                self.draws, self.dtype_guard = draws, dtype_guard
                follow = draws.follow if as_recorded else None
                last = None  # (stream, index, default dtype) of the draw right before
                for done, i in enumerate(plan.whole, 1):
                    value = targets[i].value
                    node, pos = value.node, value.index
                    try:
                        if (node.rng is not None and node.kind == "op" and node.autograd is NOTHING_SEEN
                                and not node.reshapes):
                            rs = streams[id(node.rng[0]())]
                            index = rs.index[id(node)]
                            dtype = node.default_dtype
                            if (follow is not None and last is not None and last[0] is rs and last[1] == index - 1
                                    and last[2] is dtype and continues(rs, index)):
                                out = follow(node, None, rs, index)
                                if not isinstance(out, torch.Tensor):
                                    out = flatten_output(out)[0][pos]
                            else:
                                self.draw(node, (pos,), as_recorded)
                                out = env.pop((node, pos))
                            last = (rs, index, dtype)
                        else:
                            self.run_node(node, (pos,))
                            out = env.pop((node, pos))
                            last = None
                    except Exception as e:
                        raise self._failure(node, e) from e
                    if not sink(i, out):
                        results[i] = out
                    if progress is not None:
                        progress(done, total)
                self.draw_stats = draws.stats
        finally:
            self.env = self.real_views = self.draws = self.dtype_guard = None
        return results

    def run_node(self, node: Node, wanted) -> None:
        """Run one planned node: as its mode says (:mod:`deferinit.ir.liveness`), else as
        its kind says; ``wanted``: the positions of its outputs read later."""
        mode = self._modes.get(id(node), RUN)
        if mode != RUN:
            if mode == ALLOC:
                return self.alloc(node, wanted)
            if mode == DIRECT:
                return self.direct(node)
            if mode == GENERATOR and node.rng is not None and self.draws.skip(node):
                return None  # jumped over: nothing drawn
        return _BY_KIND[node.kind](self, node, wanted)

    # -- nodes run otherwise than recorded (see deferinit/ir/liveness.py) ------------

    def alloc(self, node: Node, wanted) -> None:
        """Outputs whose contents later writes overwrite: allocated, not computed
        (a constant factory's: filled where they are read)."""
        liveness = self.plan.liveness
        _allocate(self.env, node, liveness.alloc[id(node)], wanted, self.device_map)
        part = liveness.filled.get(id(node))
        if part is not None and 0 in wanted:
            lo, hi, number = part
            self.env[(node, 0)].view(-1)[lo:hi].fill_(number)

    def direct(self, node: Node) -> None:
        """A ``copy_`` from a checkpoint tensor: read straight into its destination."""
        load, (offset, sizes, strides), *parts = self.plan.liveness.direct[id(node)]
        dst = self.resolve(node.flat[0])
        source = load.payload
        # The load cast the checkpoint to its tensor's dtype, the copy to the
        # destination's: the same two casts, unless one of them is none.
        middle = load.flat[0].value.dtype
        via = None if middle in (source.dtype, dst.dtype) else middle
        if not parts:
            source.read(dst, offset, sizes, strides, via=via)
            return
        for start, box in parts[0]:
            # Only the blocks of the destination something reads later.
            at = dst.storage_offset() + sum(i * s for i, s in zip(start, dst.stride()))
            view = dst.as_strided(box, dst.stride(), at)
            source.read(view, offset + sum(i * s for i, s in zip(start, strides)), box, strides, via=via)

    # -- nodes by kind ---------------------------------------------------------

    def load(self, node: Node, wanted) -> None:
        """A checkpoint load: its bytes into the tensor, or the parts read later."""
        dst = self.resolve(node.flat[0])
        liveness = self.plan.liveness
        parts = liveness.loads.get(id(node)) if liveness is not None else None
        node.payload.read_parts(dst, parts)

    def external(self, node: Node, wanted) -> None:
        """An outside tensor, read by reference (on the replay's device)."""
        t = node.payload
        if t._version != node.version:
            raise ExternalTensorMutatedError(
                f"an outside tensor {describe(t)} used while recording was modified in "
                f"place since (version {node.version} -> {t._version}), so the recorded "
                "values cannot be reproduced. Keep it unchanged until materialization, or "
                "pass a clone to the constructor."
            )
        t = recorded_memory(node)
        mapped = self.device_map(t.device)
        self.env[(node, 0)] = t if mapped == t.device else t.to(mapped)
        self._borrowed.add(id(self.env[(node, 0)]))

    def constant(self, node: Node, wanted) -> None:
        """A value recorded by copy."""
        self.env[(node, 0)] = node.payload.to(self.device_map(node.target), copy=True)

    def draw(self, node: Node, wanted, as_recorded=None) -> None:
        """A random operator autograd did not see, drawn whole: :meth:`call` less
        what cannot apply (no alias, no detach, no graph, no reuse of an
        input's memory, no scratch, no part), the most frequent node of a
        model's record.  ``as_recorded``: whether its arguments are passed
        as recorded (default: whether :meth:`run` found them so)."""
        if as_recorded if as_recorded is not None else id(node) in self._as_recorded:
            args = node.flat  # unflatten copies
        else:
            device_map, resolve = self.device_map, self.resolve
            args = [resolve(x) if type(x) is Input else device_map(x) if type(x) is torch.device else x
                    for x in node.flat]
        a, k = unflatten(args, node.spec)
        self.dtype_guard.set(node.default_dtype)
        self._keep(node, self.draws.call(node, a, k), wanted)

    def call(self, node: Node, wanted) -> None:
        """An operator (or an opaque initialiser) called on the real inputs: in place
        where its first input dies with it, with autograd where eager's graph
        is rebuilt, from the eager state of its generator where it draws."""
        env = self.env
        liveness = self.plan.liveness
        # Draws replayed only for the generator write into scratch memory.
        scratch = liveness.scratch.get(id(node), ()) if liveness is not None else ()
        in_place = node.kind == "op" and not scratch and reusable(self, node, env, self._uses, self._produced, self._borrowed)
        device_map = self.device_map
        facts = node.autograd
        args = []
        first_input = True
        for i, x in enumerate(node.flat):
            if type(x) is Input:
                t = scratch_for(x, device_map) if i in scratch else self.resolve(x)
                if node.reshapes and first_input and not facts.data_swap:
                    # t_(), set_(), ...: change an alias, not the tensor other
                    # values still refer to.
                    t = self._alias(node, t, len(args))
                elif i in facts.plain_writes and facts.grad is None and t.requires_grad:
                    # Eagerly written through an alias that requires no grad
                    # (resize_ refuses a tensor that does, even under no_grad).
                    t = _detach(t)
                if i in facts.data_writes and self.autograd is not None:
                    # Eagerly through t.data, whose version counter is its own:
                    # the views of t keep their grad_fn.
                    t = t.data
                first_input = False
                args.append(t)
            elif type(x) is torch.device:  # a final class
                args.append(device_map(x))
            else:
                args.append(x)
        a, k = unflatten(args, node.spec)

        self.dtype_guard.set(node.default_dtype)
        if facts.data_swap:
            out = self._swap_data(node, args)
        elif facts.grad is not None and self.autograd is not None:
            out = self._run_with_grad(node, args)
        elif in_place:
            out = in_place_variant(node.target)(*a, **k)
        elif node.rng is not None:
            part = liveness.parts.get(id(node)) if liveness is not None else None
            out = self.draws.call(node, a, k, part)
        else:
            out = caller(node.target)(*a, **k)
        self._keep(node, out, wanted)

    def _keep(self, node: Node, out, wanted) -> None:
        """Keep the outputs of ``node`` read later."""
        if wanted:
            outs = [out] if isinstance(out, torch.Tensor) else flatten_output(out)[0]
            env = self.env
            for pos in wanted:
                env[(node, pos)] = outs[pos]

    def resolve(self, inp: Input) -> torch.Tensor:
        """The real tensor an input reads: a value computed by this replay, or a view
        of memory already real."""
        value = inp.value
        if real_read(inp):
            real_views = self.real_views
            view = real_views.get(value.key)
            if view is None:
                storage = value.storage
                real = storage.real
                mapped = self.device_map(value.device)
                if real.device != mapped:
                    raise ReplayError(
                        f"a view of this tensor was already materialized on {real.device}; "
                        f"its other views must be materialized there too, not on {mapped}"
                    )
                view = torch.empty(0, dtype=value.dtype, device=real.device)
                view.set_(real, value.offset, value.size, value.stride)
                real_views[value.key] = view
            return view
        return self.env[value.key]

    def _failure(self, node: Node, e: Exception) -> Exception:
        labels = [l for l in self.labels if l]
        what = ", ".join(labels[:3]) + (f" and {len(labels) - 3} more" if len(labels) > 3 else "")
        if isinstance(e, ExternalTensorMutatedError) and what:
            e.add_note(f"(while materializing {what}; nothing was changed, the tensors stay deferred)")
        if isinstance(e, MaterializationError):
            return e
        return ReplayError(
            f"replaying {node.name} (node %{node.seq}) for {what or 'the requested tensors'} "
            f"failed: {type(e).__name__}: {e}. Nothing was changed; the tensors stay deferred."
        )

    # -- calls autograd saw: replay builds eager's graph --------------------------

    def _swap_data(self, node: Node, args: list) -> torch.Tensor:
        """``t.data = new`` (:func:`deferinit.grad.data_node`): with graphs to
        rebuild, on the tensor with ``t``'s graph, as eagerly; else an alias of
        ``new``, all that the value is."""
        t, new = args
        if self.autograd is None or not t.requires_grad:
            return _alias(new)
        key = node.flat[0].value.key
        env = self.env
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

    def _run_with_grad(self, node: Node, args: list, again: bool = False):
        """A call autograd saw, run with grad on the leaf objects; ``again``: a view
        node run again for a view of memory already real (see :meth:`_run_again`)."""
        stale: list = []
        lent = self.autograd.lent()
        flags = []
        try:
            a, k = self._bind(node, args, stale, again)
            for t in stale:
                flags.append((t, t.requires_grad))
                t.requires_grad_(not t.requires_grad)
            with torch.set_grad_enabled(not node.autograd.no_grad):
                out = self.draws.call(node, a, k) if node.rng is not None else node.target(*a, **k)
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

    def _bind(self, node: Node, args: list, stale: list, again: bool):
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
            if not again and real_read(x) and aliases_with_grad(x.value.node):
                # A view of memory already real, read with its autograd
                # relation (it requires grad through its base): taken again.
                outs = self._run_again(x.value.node)
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

    def _view_again(self, inp: Input, real: torch.Tensor, fake) -> torch.Tensor:
        """A target that is a view of memory already real, and belongs to an
        autograd graph: its view node (or the ``set_`` that made it share that
        memory) runs again on the real leaf objects."""
        node = inp.value.node
        if not real_read(inp) or not aliases_with_grad(node):
            return real
        outs = self._run_again(node)
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

    def _run_again(self, node: Node) -> list | None:
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
                        outs = self._run_again(x.value.node)
                        if outs is not None:
                            args.append(outs[x.value.index])
                            continue
                elif is_set and pos in plain and pos in node.writes:
                    # What set_ replaces: its values never matter, and no
                    # graph reaches it; a tensor of its own stands in.
                    args.append(torch.empty(0, dtype=x.value.dtype, device=self.device_map(x.value.device)))
                    continue
                elif x.value.key not in self.env:
                    return None
                x = self.resolve(x)
            args.append(x)
        out = self._run_with_grad(node, args, again=True)
        return [out] if isinstance(out, torch.Tensor) else flatten_output(out)[0]


_BY_KIND = {"op": Replay.call, "opaque": Replay.call, "external": Replay.external,
            "constant": Replay.constant, "load": Replay.load}


def _allocate(env, node, allocs, wanted, device_map) -> None:
    for pos, value in allocs.items():
        if pos in wanted:
            env[(node, pos)] = torch.empty_strided(value.size, value.stride, dtype=value.dtype,
                                                   device=device_map(value.device))


def aliases_with_grad(node: Node) -> bool:
    """A view, or a ``set_`` from a tensor, that autograd saw eagerly."""
    if node.kind != "op" or node.autograd.grad is None or node.rng is not None:
        return False
    info = op_info(node.target)
    return info.view_arg is not None or info.opname == "set_"


def scratch_for(inp, device_map) -> torch.Tensor:
    """Memory of ``inp``'s geometry for a draw whose values nothing reads: the
    kernel consumes the generator as it would on the real tensor."""
    value = inp.value
    return torch.empty_strided(value.size, value.stride, dtype=value.dtype, device=device_map(value.device))


class _DefaultDtype:
    """Sets the default dtype a node was recorded under, restoring it at the end
    (a class, not a ``contextlib`` generator: see deferinit.fake.guard)."""

    def __init__(self):
        self.original = torch.get_default_dtype()
        self.current = self.original

    def set(self, dtype) -> None:
        dtype = dtype or torch.float32
        if dtype is not self.current:
            torch.set_default_dtype(dtype)
            self.current = dtype

    def __enter__(self) -> "_DefaultDtype":
        return self

    def __exit__(self, *exc) -> None:
        try: self._restore()  # noqa: E701 - one line each: see deferinit.fake.guard
        finally: self._restore()  # noqa: E701

    def _restore(self) -> None:
        if torch.get_default_dtype() is not self.original:
            torch.set_default_dtype(self.original)
        self.current = self.original


def recorded_memory(node: Node) -> torch.Tensor:
    """An external node's tensor as it was recorded: the tensor itself (autograd
    links to it), or, if ``t.data = other`` gave it other memory since, a
    tensor on the memory it had then (which eager read at that point).

    Example::

        >>> w = torch.ones(2)
        >>> m = deferred_init(lambda: torch.nn.Parameter(w * 2))
        >>> w.data = torch.zeros(2)
        >>> materialize_tensor(m).tolist()
        [2.0, 2.0]
    """
    t = node.payload
    if node.memory is None:
        return t
    storage, dtype, offset, shape, stride, conj, neg = node.memory
    now = (t.untyped_storage()._cdata, t.dtype, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.is_conj(), t.is_neg())
    if now == (storage._cdata, dtype, offset, shape, stride, conj, neg):
        return t
    with no_python_dispatch(), torch.no_grad():
        out = torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, shape, stride)
        out = out.conj() if conj else out
        return torch._neg_view(out) if neg else out
