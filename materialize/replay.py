"""The interpreter: replays the part of a record that some tensors need.

In the spirit of ``torch.fx.Interpreter``: one loop over the planned nodes
in recorded order (:class:`deferinit.plan.Plan` chose them), one
``_run_node`` where values are computed, each value freed at its last use.
Random nodes draw from the state their generator had eagerly, on private
generators (:mod:`deferinit.materialize.draws`; draws needed only for that
state are jumped over on CPU); the states later replays look up are cached
on the record, so any order of requests costs at most one extra pass.

Everything runs below autograd (``no_grad``, or ``inference_mode`` on request),
except, when ``autograd=`` is given, the calls autograd recorded eagerly:
those run with grad enabled on the leaf objects ``autograd`` hands out, so
that tensors computed from parameters get eager's graph.
"""

from __future__ import annotations

import torch

from deferinit.errors import DeviceUnavailableError, ExternalTensorMutatedError, MaterializationError, ReplayError
from deferinit.graph import Input, Node
from deferinit.liveness import GENERATOR, RUN
from deferinit.plan import Plan, real_read, read_of
from deferinit.fake.device import exists
from deferinit.fake.bypass import no_python_dispatch
from deferinit.fake.gradmode import below_autograd
from deferinit.fake.flat import flatten_output, unflatten
from deferinit.fake.tensor import describe

from .autograd import real_root
from .gradcalls import GradCalls
from .draws import Draws
from .modes import check_sources, run_marked, scratch_for
from .reuse import in_place_variant, reusable

__all__ = ["Replay", "read_of"]

_detach = torch.ops.aten.detach.default


class Replay(GradCalls, Plan):
    """One replay: the closure of some reads, executed in recorded order.

    Example (what ``materialize_tensor`` does, minus the swap)::

        >>> m = deferred_init(torch.nn.Linear, 2, 3)
        >>> (w,) = Replay([read_of(m.weight)]).run()
        >>> type(w), w.shape
        (<class 'torch.Tensor'>, torch.Size([3, 2]))
    """

    def __init__(self, targets: list[Input], *, device=None, inference: bool = False, labels=None, progress=None, check_devices: bool = True, extra=(), autograd=None):
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
        super().__init__(targets, device=device, extra=extra, eliminate=autograd is None)
        if check_devices:
            self._check_devices()

    def _check_devices(self) -> None:
        devices = set()
        for node in self.order:
            for x in node.flat:
                if type(x) is Input:
                    devices.add(x.value.device)
                elif isinstance(x, torch.device):
                    devices.add(x)
            if node.kind == "constant":
                devices.add(node.target)
        for inp in self.targets:
            devices.add(inp.value.device)
        for device in devices:
            mapped = self.device_map(device)
            if not exists(mapped):
                label = next((l for l in self.labels if l), "the tensor")
                raise DeviceUnavailableError(
                    f"cannot materialize {label} on {mapped}: this process has no such device "
                    f"(the record asks for {device}). Pass device='cpu' (or another device that "
                    "exists) to materialize elsewhere."
                )

    # -- execution --------------------------------------------------------------

    def run(self) -> list[torch.Tensor]:
        """Execute the plan; returns one real tensor per target read."""
        check_sources(self)
        uses: dict = {}
        wanted: dict[int, set] = {}
        # The recorded geometry of each output read (see materialize/reuse.py).
        self._produced = produced = {}
        for node in self.order:
            for x in self.reads(node):
                if not real_read(x):
                    key = x.value.key
                    uses[key] = uses.get(key, 0) + 1
                    wanted.setdefault(id(key[0]), set()).add(key[1])
                    produced.setdefault(key, x.value)
        for inp in self.targets:
            if not real_read(inp):
                key = inp.value.key
                uses[key] = uses.get(key, 0) + 1_000_000_000  # never freed
                wanted.setdefault(id(key[0]), set()).add(key[1])
                produced.setdefault(key, inp.value)

        env: dict = {}
        real_views: dict = {}
        total = len(self.order)
        self._uses = uses
        self._borrowed = set()  # ids of outside tensors, read by reference
        with Draws(self.streams) as draws, no_python_dispatch(), below_autograd(self.inference), _DefaultDtype() as dtype_guard:
            binder = self.autograd
            for done, node in enumerate(self.order):
                if binder is not None:
                    binder.advance(node.seq)
                try:
                    self._run_node(node, env, real_views, wanted.get(id(node), ()), dtype_guard, draws)
                except Exception as e:
                    raise self._failure(node, e) from e
                for x in self.reads(node):
                    if not real_read(x):
                        key = x.value.key
                        left = uses[key] - 1
                        uses[key] = left
                        if left == 0:
                            env.pop(key, None)
                if self.progress is not None:
                    self.progress(done + 1, total)
            self.draw_stats = draws.stats
            if binder is not None:
                binder.advance(float("inf"))
            results = [self._resolve(inp, env, real_views) for inp in self.targets]
            for i in getattr(self.autograd, "views_again", ()):
                again = self._view_again(self.targets[i], env, real_views, results[i], binder.targets[i])
                if again is not results[i]:
                    if real_root(self.targets[i].value) is not None:
                        # Taken from the real leaf it is a view of.
                        self.retaken.add(i)
                    results[i] = again
        return results

    def _run_node(self, node: Node, env, real_views, wanted, dtype_guard, draws) -> None:
        mode = self.mode(node)
        if mode == GENERATOR and node.rng is not None and draws.skip(node):
            return  # jumped over: nothing drawn
        if (mode != RUN or node.kind == "load") and run_marked(self, node, mode, env, real_views, wanted):
            return
        # Draws replayed only for the generator write into scratch memory.
        scratch = self.liveness.scratch.get(id(node), ()) if self.liveness is not None else ()
        kind = node.kind
        in_place = kind == "op" and not scratch and reusable(self, node, env, self._uses, self._produced, self._borrowed)
        if kind == "external":
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
            env[(node, 0)] = t if mapped == t.device else t.to(mapped)
            self._borrowed.add(id(env[(node, 0)]))
            return
        if kind == "constant":
            env[(node, 0)] = node.payload.to(self.device_map(node.target), copy=True)
            return

        device_map = self.device_map
        args = []
        first_input = True
        for i, x in enumerate(node.flat):
            if type(x) is Input:
                t = scratch_for(x, device_map) if i in scratch else self._resolve(x, env, real_views)
                if node.reshapes and first_input and not node.data_swap:
                    # t_(), set_(), ...: change an alias, not the tensor other
                    # values still refer to.
                    t = self._alias(node, t, len(args))
                elif i in node.plain_writes and node.grad is None and t.requires_grad:
                    # Eagerly written through an alias that requires no grad
                    # (resize_ refuses a tensor that does, even under no_grad).
                    t = _detach(t)
                if i in node.data_writes and self.autograd is not None:
                    # Eagerly through t.data, whose version counter is its own:
                    # the views of t keep their grad_fn.
                    t = t.data
                first_input = False
                args.append(t)
            elif isinstance(x, torch.device):
                args.append(device_map(x))
            else:
                args.append(x)
        a, k = unflatten(args, node.spec)

        dtype_guard.set(node.default_dtype)
        if node.data_swap:
            out = self._swap_data(node, args, env)
        elif node.grad is not None and self.autograd is not None:
            out = self._run_with_grad(node, args, draws, env, real_views)
        elif in_place:
            out = in_place_variant(node.target)(*a, **k)
        else:
            part = self.liveness.parts.get(id(node)) if self.liveness is not None and node.rng is not None else None
            out = draws.call(node, a, k, part) if node.rng is not None else node.target(*a, **k)

        if wanted:
            outs = [out] if isinstance(out, torch.Tensor) else flatten_output(out)[0]
            for pos in wanted:
                env[(node, pos)] = outs[pos]

    def _resolve(self, inp: Input, env, real_views) -> torch.Tensor:
        value = inp.value
        if real_read(inp):
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
        return env[value.key]

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
