"""PyTorch's memory and FLOP trackers, as the planned step runs them.

``MemTracker`` (``FSDPMemTracker`` for FSDP2) and ``FlopCounterMode`` do
the accounting: which storages are alive, in which category, the peak of
each module, the FLOPs of each operator.  What this module changes is how
they reach that accounting, never what it counts: they run after every
operator of a step (33,000 operators for a 70B Llama over 8 ranks), and
PyTorch's per-operator path costs more than the fake operator it watches
(a pytree walk over each result, a mode pushed and popped to try a
decomposition that most operators do not have).  Tests run these classes
and PyTorch's own on the same real steps and compare every figure
(``tests/deferinit/test_plan_trackers.py``).

Example::

    >>> layer, tracker = torch.nn.Linear(8, 8), Tracker()
    >>> with Flops(tracker._mod_tracker) as counter, tracker:
    ...     layer(torch.randn(2, 8)).sum().backward()
    >>> counter.get_total_flops(), tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] > 0
    (512, True)
"""

from __future__ import annotations

import weakref
from functools import partial

import torch
from torch._guards import active_fake_mode
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _ModState
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only
from torch.utils.flop_counter import FlopCounterMode, _FlopCounterMode
from torch.utils.weak import WeakIdKeyDictionary

_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default
_SCALARS = (int, float, bool, str, torch.dtype, torch.device)


def local_tensor(t):
    """The local tensor of a DTensor, else ``t``: DTensor reports the C++ device of its
    local tensor, which for a fake CUDA tensor on a build without CUDA is CPU.

    Example::

        >>> from torch.distributed.tensor import Shard, distribute_tensor
        >>> from deferinit.planning import fake_ranks
        >>> with fake_ranks(4, 0, "cpu") as mesh:
        ...     local_tensor(distribute_tensor(torch.ones(8), mesh, [Shard(0)])).shape
        torch.Size([2])
        >>> t = torch.ones(3); local_tensor(t) is t
        True
    """
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def _each_tensor(value, track, reftype) -> None:
    """``track(reftype, t)`` for every tensor of an operator's result, in the order
    of ``tree_map_only(torch.Tensor, ...)``, which other containers still go to."""
    if isinstance(value, torch.Tensor):
        track(reftype, value)
    elif type(value) is tuple or type(value) is list:
        for item in value:
            _each_tensor(item, track, reftype)
    elif value is not None and type(value) not in _SCALARS:
        tree_map_only(torch.Tensor, partial(track, reftype), value)


class _Adjusted:
    """Adjustments to PyTorch's memory trackers, none changing a figure.

    * A DTensor is accounted on its local tensor's device: DTensor reports
      the C++ device of its local tensor, which for a fake CUDA tensor on a
      build without CUDA is CPU.
    * ``_update_peak_stats``, run after every operator, visits only the
      modules running (``_mod_tracker.parents``), found by name in an index
      kept beside ``memory_tracking``, instead of every module seen so far:
      the same updates, but the cost of a step no longer grows with the
      square of the number of layers (80 layers: minutes -> seconds).
    * Every change to the running totals can be recorded (``timeline``, a
      :class:`~deferinit.planning.timeline.Timeline`): the step's memory over time.
    * ``__torch_dispatch__`` does what PyTorch's does, in its order, but walks
      an operator's result without pytree when it is a tensor, a list or a
      tuple (``_each_tensor``) and looks at the dispatch state once.
    """

    timeline = None
    # The categories and module states of the tracker (MemTracker's; FSDPMemTracker's differ).
    _REF = _MemRefType
    _STATE = _ModState

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in types:
            if t is DTensor:
                return NotImplemented  # DTensor first: it calls back with its local tensors
        if func is _WAIT_TENSOR and active_fake_mode():
            res = args[0]  # PyTorch's: the meta kernel of wait_tensor makes a tensor eager does not
        else:
            res = func(*args, **kwargs or {})
        # Ops of DTensor's propagation under a FakeTensorMode of its own are not the step's.
        if active_fake_mode() is self._fake_mode_on_entry:
            backward = self._mod_tracker.is_bw
            if self._in_opt:
                reftype = self._REF.OPT
            elif backward and not self._in_ac:
                reftype = self._REF.TEMP
            else:
                reftype = self._REF.ACT
            self._collective_buffers(func, args)
            _each_tensor(res, self._track, reftype)
            self._update_peak_stats(self._STATE.PEAK_BW if backward else self._STATE.PEAK_FW)
        return res

    # As PyTorch wraps the dispatch of each of its modes (TorchDispatchMode.__init_subclass__,
    # which does not see a mixin's): Dynamo never traces into it.
    __torch_dispatch__ = torch._disable_dynamo(__torch_dispatch__, recursive=True)

    def _collective_buffers(self, func, args) -> None:
        """Before the result is tracked: FSDP's communication buffers (FSDPTracker)."""

    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
        if self.timeline is not None:
            self.timeline.record(self, u_type, winfo, old_mem_consumed, old_reftype)

    def _update_and_maybe_create_winfos(self, t, reftype, update_existing=False):
        return super()._update_and_maybe_create_winfos(local_tensor(t), reftype, update_existing)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.memory_tracking = _StatsByModule()

    def _update_peak_stats(self, peak_state) -> None:
        by_name = self.memory_tracking.by_name
        curr_snap = self._curr_mem_snap
        for name in self._mod_tracker.parents:
            for _, mod_stats in by_name.get(name, _NONE).values():
                if peak_state in mod_stats.snapshots:
                    for dev, dev_snap in curr_snap.items():
                        if mod_stats.local_peak.get(dev, 0) < dev_snap["Total"]:
                            mod_stats.local_peak[dev] = dev_snap["Total"]
                            mod_stats.snapshots[peak_state][-1][dev] = dict(dev_snap)  # {category: int}: a copy is a deep copy
        for dev, dev_snap in curr_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap["Total"]:
                self._peak_mem[dev] = dev_snap["Total"]
                self._peak_mem_snap[dev] = dict(dev_snap)


_NONE: dict = {}


class _StatsByModule(WeakIdKeyDictionary):
    """The trackers' ``memory_tracking`` ({module: _ModMemStats}), also indexed by
    the module's name: ``_update_peak_stats`` looks up the running modules by
    name after every operator.

    Several modules can share a name (modules outside the model's tree, such
    as blocks in a plain list, are named by their class) and PyTorch updates
    each of them while that name runs: ``by_name`` is {name: {id(module):
    (weak reference, stats)}}, dead modules dropped as others are added.
    """

    def __init__(self) -> None:
        super().__init__()
        self.by_name: dict = {}

    def _index(self, module, stats) -> None:
        same_name = self.by_name.setdefault(stats.mod_fqn, {})
        for key in [k for k, (ref, _) in same_name.items() if ref() is None]:
            del same_name[key]
        same_name[id(module)] = (weakref.ref(module), stats)

    def __setitem__(self, module, stats) -> None:
        super().__setitem__(module, stats)
        self._index(module, stats)

    def setdefault(self, module, default=None):
        stats = super().setdefault(module, default)
        self._index(module, stats)
        return stats

    def update(self, other=None, **kwargs) -> None:
        for module, stats in dict(other or {}).items():
            self[module] = stats
        if kwargs:
            raise TypeError("memory_tracking is keyed by module")

    def clear(self) -> None:
        super().clear()
        self.by_name.clear()


class Tracker(_Adjusted, MemTracker):
    """PyTorch's ``MemTracker`` (see :class:`_Adjusted`)."""


def fsdp_tracker(model, optimizer):
    """PyTorch's ``FSDPMemTracker(model, optimizer)`` (see :class:`_Adjusted`)."""
    from torch.distributed._tools.fsdp2_mem_tracker import (
        FSDPMemTracker, _FSDPModState, _FSDPRefType, _FSDPState,
    )

    c10d = torch.ops.c10d

    class FSDPTracker(_Adjusted, FSDPMemTracker):
        _REF = _FSDPRefType
        _STATE = _FSDPModState

        def _collective_buffers(self, func, args) -> None:
            # FSDPMemTracker's: the all-gather output and reduce-scatter input
            # FSDP allocated are tracked as such, not as the step's temporaries.
            if func is c10d._allgather_base_.default and self._fsdp_state in (_FSDPState.PRE_FW, _FSDPState.PRE_BW):
                self._update_and_maybe_create_winfos(args[0], _FSDPRefType.ALL_GATHER, update_existing=True)
            if func is c10d._reduce_scatter_base_.default and self._fsdp_state == _FSDPState.POST_BW:
                self._update_and_maybe_create_winfos(args[1], _FSDPRefType.REDUCE_SCATTER, update_existing=True)

    return FSDPTracker(model, optimizer)


class Flops(FlopCounterMode):
    """PyTorch's ``FlopCounterMode``, attributing operators to the modules that the
    memory tracker's ``ModTracker`` says are running.

    ``FlopCounterMode``'s own ``ModuleTracker`` registers gradient hooks on the
    tensors that activation checkpointing recomputes in the backward pass;
    those hooks form reference cycles that keep the recomputed activations
    alive until Python's cyclic collector runs, so the memory measured beside
    it would depend on when the collector happens to run.  The memory
    tracker's ``ModTracker`` names modules the same way and makes no such
    cycle; sharing it also halves the module hooks of the step.
    """

    def __init__(self, mod_tracker) -> None:
        super().__init__(display=False)
        self.mod_tracker = mod_tracker

    def __enter__(self):
        self.flop_counts.clear()
        self.mode = _FlopMode(self)
        self.mode.__enter__()
        return self

    def __exit__(self, *args):
        mode, self.mode = self.mode, None
        return mode.__exit__(*args)


_aten = torch.ops.aten
# Operators of the sizes-and-strides policy FlopCounterMode leaves to the tensor.
_SIZE_QUERIES = frozenset({
    _aten.sym_is_contiguous.default, _aten.is_contiguous.default, _aten.is_contiguous.memory_format,
    _aten.is_strides_like_format.default, _aten.is_non_overlapping_and_dense.default, _aten.size.default,
    _aten.sym_size.default, _aten.stride.default, _aten.sym_stride.default, _aten.storage_offset.default,
    _aten.sym_storage_offset.default, _aten.numel.default, _aten.sym_numel.default, _aten.dim.default,
    torch.ops.prim.layout.default,
})
_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd


class _FlopMode(_FlopCounterMode):
    """FlopCounterMode's dispatch mode, with what it asks of every operator remembered.

    PyTorch's ``__torch_dispatch__`` builds its set of size queries on each
    call and, for every operator without a FLOP formula of its own overload
    (the registry is keyed by packet: all of them), enters the mode again to
    try ``func.decompose``, which returns NotImplemented unless the operator
    has a CompositeImplicitAutograd kernel.  Here the set is built once and
    whether an operator has such a kernel is asked once: the same
    decompositions, counts and results.
    """

    _decomposes: dict = {}  # operator -> whether decompose() can run it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs if kwargs else {}
        if func in _SIZE_QUERIES:
            return NotImplemented
        if isinstance(func, torch._ops.HigherOrderOperator):
            return self._handle_higher_order_ops(func, types, args, kwargs)
        if func not in self.counter.flop_registry and func is not torch.ops.prim.device.default:
            decomposes = self._decomposes.get(func)
            if decomposes is None:
                decomposes = self._decomposes[func] = (
                    _COMPOSITE in func.py_kernels or torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _COMPOSITE)
                )
            if decomposes:
                with self:
                    r = func.decompose(*args, **kwargs)
                    if r is not NotImplemented:
                        return r
        out = func(*args, **kwargs)
        return self.counter._count_flops(func._overloadpacket, out, args, kwargs)
