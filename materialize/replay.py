"""The interpreter: replays the part of a record that some tensors need.

In the spirit of ``torch.fx.Interpreter``: one loop over the planned nodes
in recorded order (:class:`deferinit.plan.Plan` chose them), one
``_run_node`` where values are computed, each value freed at its last use.
Random nodes draw from the state their generator had eagerly, on private
generators (:mod:`materialize.draws`); every state passed is cached on the
record, so any order of requests costs at most one extra pass.

Everything runs below autograd (``no_grad``, or ``inference_mode`` on request),
except, when ``autograd=`` is given, the calls autograd recorded eagerly:
those run with grad enabled on the leaf objects ``autograd`` hands out, so
that tensors computed from parameters get eager's graph.
"""

from __future__ import annotations

import contextlib

import torch

from deferinit.errors import DeviceUnavailableError, ExternalTensorMutatedError, MaterializationError, ReplayError
from deferinit.graph import Input, Node
from deferinit.liveness import RUN
from deferinit.plan import Plan, real_read, read_of
from fake.device import exists
from fake.bypass import no_python_dispatch
from fake.flat import flatten_output, unflatten
from fake.opinfo import op_info
from fake.tensor import describe

from .autograd import view_again
from .draws import Draws
from .modes import check_sources, run_marked, scratch_for

__all__ = ["Replay", "read_of"]

_alias = torch.ops.aten.alias.default
_detach = torch.ops.aten.detach.default
_get_creation_meta = torch._C._autograd._get_creation_meta
_set_creation_meta = torch._C._autograd._set_creation_meta


class Replay(Plan):
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
                "Keep it deferred (it already reports shape, dtype and device), or use fake.meta_like."
            )
        self.inference = inference
        # autograd(leaf, tensor, input) -> the leaf object to compute on, for
        # the inputs of nodes autograd recorded (see materialize/autograd.py).
        self.autograd = autograd
        self.labels = labels or [None] * len(targets)
        self.progress = progress
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
        for node in self.order:
            for x in self.reads(node):
                if not real_read(x):
                    key = x.value.key
                    uses[key] = uses.get(key, 0) + 1
                    wanted.setdefault(id(key[0]), set()).add(key[1])
        for inp in self.targets:
            if not real_read(inp):
                key = inp.value.key
                uses[key] = uses.get(key, 0) + 1_000_000_000  # never freed
                wanted.setdefault(id(key[0]), set()).add(key[1])

        env: dict = {}
        real_views: dict = {}
        total = len(self.order)
        self._uses = uses
        with Draws(self.streams) as draws, no_python_dispatch(), _grad_mode(self.inference), _default_dtype_guard() as dtype_guard:
            for done, node in enumerate(self.order):
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
            results = [self._resolve(inp, env, real_views) for inp in self.targets]
            for i in getattr(self.autograd, "views_again", ()):
                results[i] = self._view_again(self.targets[i], env, real_views, results[i])
        return results

    def _run_node(self, node: Node, env, real_views, wanted, dtype_guard, draws) -> None:
        mode = self.mode(node)
        if (mode != RUN or node.kind == "load") and run_marked(self, node, mode, env, real_views, wanted):
            return
        # Draws replayed only for the generator write into scratch memory.
        scratch = self.liveness.scratch.get(id(node), ()) if self.liveness is not None else ()
        kind = node.kind
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
                if node.reshapes and first_input:
                    # t_(), set_(), ...: change an alias, not the tensor other
                    # values still refer to.
                    t = self._alias(node, t, len(args))
                first_input = False
                args.append(t)
            elif isinstance(x, torch.device):
                args.append(device_map(x))
            else:
                args.append(x)
        a, k = unflatten(args, node.spec)

        dtype_guard.set(node.default_dtype)
        if node.grad is not None and self.autograd is not None:
            out = self._run_with_grad(node, args, draws)
        else:
            out = draws.call(node, a, k) if node.rng is not None else node.target(*a, **k)

        if wanted:
            outs = [out] if isinstance(out, torch.Tensor) else flatten_output(out)[0]
            for pos in wanted:
                env[(node, pos)] = outs[pos]

    def _alias(self, node: Node, t: torch.Tensor, pos: int) -> torch.Tensor:
        if self.autograd is None:
            return _alias(t)
        # Under autograd the tensor must be what it was eagerly: the very
        # tensor when it has a graph or is a view (its grad_fn is kept, or
        # regenerated from the view after the in-place op), else a tensor
        # of its own.
        plain = node.grad is not None and any(p == pos and leaf is None for p, leaf in node.grad)
        key = node.flat[pos].value.key
        alone = self._uses.get(key, 0) <= 1  # nothing reads the old value after this node
        if alone and ((t.requires_grad and not plain) or (node.grad is not None and t._is_view())):
            return t
        if node.grad is not None or not (t.requires_grad or t._is_view()):
            # No autograd view where eagerly the tensor is none: an alias
            # taken under no_grad would refuse a later in-place op under grad
            # mode (``p.data.copy_(p)`` after ``p.t_()``), eagerly allowed.
            return _detach(t)
        out = _alias(t)
        if t._is_view():
            # The view it is eagerly, taken in the grad mode it was taken in.
            _set_creation_meta(out, _get_creation_meta(t))
        return out

    def _run_with_grad(self, node: Node, args: list, draws=None):
        bound = set()
        for pos, leaf in node.grad:
            bound.add(pos)
            if leaf is None:
                if args[pos].requires_grad:
                    # What t.data gives: no graph, a version counter of its own.
                    args[pos] = args[pos].data
            else:
                args[pos] = self.autograd(leaf, args[pos], node.flat[pos])
        if not node.no_grad:
            for pos, x in enumerate(node.flat):
                if pos not in bound and type(x) is Input and args[pos].requires_grad:
                    # Autograd reads its grad_fn here, eagerly without error.
                    args[pos] = view_again(args[pos])
        a, k = unflatten(args, node.spec)
        with torch.set_grad_enabled(not node.no_grad):
            return draws.call(node, a, k) if node.rng is not None else node.target(*a, **k)

    def _view_again(self, inp: Input, env, real_views, real: torch.Tensor) -> torch.Tensor:
        """A target that is a view of memory already real, and belongs to an
        autograd graph: its view node (or the ``set_`` that made it share that
        memory) runs again on the real leaf objects."""
        if not real_read(inp) or not _aliases_with_grad(inp.value.node):
            return real
        outs = self._run_again(inp.value.node, env, real_views)
        return real if outs is None else outs[inp.value.index]

    def _run_again(self, node: Node, env, real_views) -> list | None:
        """The outputs of ``node`` run again with grad, or None where an input is gone."""
        is_set = op_info(node.target).opname == "set_"
        bound = {pos for pos, leaf in node.grad if leaf is not None}
        plain = {pos for pos, leaf in node.grad if leaf is None}
        args = []
        for pos, x in enumerate(node.flat):
            if type(x) is Input:
                storage = x.value.storage
                if storage is not None and storage.real is not None:
                    # A view depends on the geometry, not on the version read.
                    x = Input(x.value, storage.real_head)
                    if pos not in bound and _aliases_with_grad(x.value.node):
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


def _aliases_with_grad(node: Node) -> bool:
    """A view, or a ``set_`` from a tensor, that autograd saw eagerly."""
    if node.kind != "op" or node.grad is None or node.rng is not None:
        return False
    info = op_info(node.target)
    return info.view_arg is not None or info.opname == "set_"


@contextlib.contextmanager
def _grad_mode(inference: bool):
    """``inference_mode()``, or ``no_grad()`` outside any ambient inference mode:
    tensors recorded as normal ones stay normal when materialized inside one."""
    if inference:
        with torch.inference_mode():
            yield
    else:
        with torch.inference_mode(False), torch.no_grad():
            yield


class _DefaultDtype:
    """Sets the default dtype a node was recorded under, restoring it at the end."""

    def __init__(self):
        self.original = torch.get_default_dtype()
        self.current = self.original

    def set(self, dtype) -> None:
        dtype = dtype or torch.float32
        if dtype is not self.current:
            torch.set_default_dtype(dtype)
            self.current = dtype


@contextlib.contextmanager
def _default_dtype_guard():
    guard = _DefaultDtype()
    try:
        yield guard
    finally:
        if guard.current is not guard.original:
            torch.set_default_dtype(guard.original)


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
