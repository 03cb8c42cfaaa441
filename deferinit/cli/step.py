"""One training step measured by PyTorch's own trackers.

The step is what a training loop does once: forward, loss, backward, the
optimizer's step, ``zero_grad``.  Memory is PyTorch's
``torch.distributed._tools.mem_tracker.MemTracker`` (``FSDPMemTracker``
for a model sharded with FSDP2), FLOPs are
``torch.utils.flop_counter.FlopCounterMode``: no accounting of our own.
On real tensors this measures the real step; inside ``fake.fake_mode`` the
same code measures the step of a deferred model without allocating, and the
figures agree byte for byte (``tests/deferinit/test_plan.py``).

Example::

    >>> model = torch.nn.Linear(64, 64)
    >>> opt = torch.optim.AdamW(model.parameters())
    >>> m = measure_step(model, (torch.randn(8, 64),), {}, opt)
    >>> m.peak[torch.device("cpu")]["Total"] > 0, m.flops
    (True, 131072)
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.flop_counter import FlopCounterMode

#: What each of PyTorch's memory categories counts, in the report's words.
LABELS = {
    "PARAM": "parameters", "SHARDED_PARAM": "parameters (local shard)",
    "UNSHARDED_PARAM": "parameters (gathered)", "BUFFER": "buffers",
    "GRAD": "gradients", "SHARDED_GRAD": "gradients (local shard)",
    "UNSHARDED_GRAD": "gradients (gathered)", "OPT": "optimizer state",
    "ACT": "activations", "TEMP": "temporaries", "INP": "inputs",
    "ALL_GATHER": "all-gather buffers", "REDUCE_SCATTER": "reduce-scatter buffers",
    "OTH": "other",
}

#: The five columns of the per-module table, and the categories each sums.
COLUMNS = {
    "parameters": ("PARAM", "SHARDED_PARAM", "UNSHARDED_PARAM", "BUFFER"),
    "gradients": ("GRAD", "SHARDED_GRAD", "UNSHARDED_GRAD"),
    "optimizer": ("OPT",),
    "activations": ("ACT", "INP"),
    "temporaries": ("TEMP", "ALL_GATHER", "REDUCE_SCATTER", "OTH"),
}


def _local(t):
    # DTensor reports the C++ device of its local tensor, which for a fake
    # CUDA tensor on a build without CUDA is CPU; account the local tensor.
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


class _Adjusted:
    """Two adjustments to PyTorch's memory trackers, neither changing a figure.

    * A DTensor is accounted on its local tensor's device: DTensor reports
      the C++ device of its local tensor, which for a fake CUDA tensor on a
      build without CUDA is CPU.
    * ``_update_peak_stats``, run after every operator, visits only the
      modules running (``_mod_tracker.parents``) instead of every module
      seen so far: the same updates, but the cost of a step no longer grows
      with the square of the number of layers (80 layers: minutes -> seconds).
    """

    def _update_and_maybe_create_winfos(self, t, reftype, update_existing=False):
        return super()._update_and_maybe_create_winfos(_local(t), reftype, update_existing)

    def _update_peak_stats(self, peak_state) -> None:
        by_name = self.__dict__.get("_stats_by_name")
        if by_name is None or len(by_name) != len(self.memory_tracking):
            by_name = self.__dict__["_stats_by_name"] = {s.mod_fqn: s for s in self.memory_tracking.values()}
        curr_snap = self._curr_mem_snap
        for name in self._mod_tracker.parents:
            mod_stats = by_name.get(name)
            if mod_stats is not None and peak_state in mod_stats.snapshots:
                for dev, dev_snap in curr_snap.items():
                    if mod_stats.local_peak.get(dev, 0) < dev_snap["Total"]:
                        mod_stats.local_peak[dev] = dev_snap["Total"]
                        mod_stats.snapshots[peak_state][-1][dev] = copy.deepcopy(dev_snap)
        for dev, dev_snap in curr_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap["Total"]:
                self._peak_mem[dev] = dev_snap["Total"]
                self._peak_mem_snap[dev] = copy.deepcopy(dev_snap)


class Tracker(_Adjusted, MemTracker):
    """PyTorch's ``MemTracker`` (see :class:`_Adjusted`)."""


def fsdp_tracker(model, optimizer):
    """PyTorch's ``FSDPMemTracker(model, optimizer)`` (see :class:`_Adjusted`)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    class FSDPTracker(_Adjusted, FSDPMemTracker):
        pass

    return FSDPTracker(model, optimizer)


def loss_of(output, token_ids=None) -> torch.Tensor:
    """The loss to back-propagate: the model's own (``output.loss``), else the
    cross entropy of logits against ``token_ids``, else the mean of the output."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if not isinstance(output, torch.Tensor):
        logits = getattr(output, "logits", None)
        output = logits if isinstance(logits, torch.Tensor) else next(
            t for t in (output.values() if isinstance(output, dict) else output) if isinstance(t, torch.Tensor)
        )
    if token_ids is not None and output.shape[:-1] == token_ids.shape:
        return F.cross_entropy(output.flatten(0, -2).float(), token_ids.flatten())
    return output.float().mean()


@dataclasses.dataclass
class Measured:
    """What one step measured: ``peak`` is ``{device: {category: bytes, "Total": bytes}}``
    (category names as in PyTorch's ``_MemRefType`` / ``_FSDPRefType``), ``flops``
    the step's total; ``tracker`` and ``counter`` are PyTorch's objects, for
    per-module figures."""

    peak: dict
    flops: int
    tracker: MemTracker
    counter: FlopCounterMode
    forward_flops: dict  # FlopCounterMode's counts after the forward pass: {module name: {op: flops}}
    after: dict  # like ``peak``, once the step is done: what stays between steps


def measure_step(model, args, kwargs, optimizer, *, token_ids=None, sharded: bool = False) -> Measured:
    """Run one training step of ``model`` under PyTorch's trackers.

    ``model(*args, **kwargs)`` is the forward pass; the loss is
    :func:`loss_of`; then ``backward()``, ``optimizer.step()`` and
    ``optimizer.zero_grad()``.  ``sharded``: the model is sharded with FSDP2
    (``FSDPMemTracker``).
    """
    if sharded:
        tracker = fsdp_tracker(model, optimizer)
        tracker.track_inputs(tuple(args) + tuple(kwargs.values()))
    else:
        tracker = Tracker()
        tracker.track_external(model, optimizer)
    counter = FlopCounterMode(display=False)
    # The memory tracker inside the counter: the counter decomposes some
    # operators, and only their results are allocations of the step.
    with counter, tracker:
        loss = loss_of(model(*args, **kwargs), token_ids)
        # Per module, the forward pass's counts: in the backward pass PyTorch's
        # module tracker may hold several modules active at once (a tensor
        # several blocks read), which counts some operators more than once.
        forward = counter.get_flop_counts()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        after = _named(tracker.get_tracker_snapshot())
    return Measured(_named(tracker.get_tracker_snapshot("peak")), counter.get_total_flops(), tracker, counter, forward, after)


def _named(snapshot) -> dict:
    return {device: {getattr(k, "name", k): v for k, v in cats.items()} for device, cats in snapshot.items()}


def module_peak(measured: Measured, module, device) -> tuple[str, dict] | None:
    """``(phase, {category: bytes, "Total": bytes})`` on ``device`` at the highest point
    while ``module`` ran (phase ``"forward"`` or ``"backward"``), or None if it never ran.

    It is the whole device's memory at that moment, not what the module owns."""
    stats = measured.tracker.memory_tracking.get(module)
    if stats is None:
        return None
    best = None
    for state, snaps in stats.snapshots.items():
        # MemTracker's _ModState and FSDPMemTracker's _FSDPModState name them alike.
        phase = {"PEAK_FW": "forward", "PEAK_BW": "backward"}.get(state.name)
        if phase is None:
            continue
        for snap in snaps:
            cats = snap.get(device)
            if cats is not None and (best is None or cats["Total"] > best[1]["Total"]):
                best = (phase, {getattr(k, "name", k): v for k, v in cats.items()})
    return best


def forward_flops(measured: Measured, module=None) -> int:
    """FLOPs of the forward pass in ``module`` (the whole forward pass: None)."""
    if module is None:
        return sum(measured.forward_flops.get("Global", {}).values())
    name = measured.counter.mod_tracker._known_modules.get(module)
    return sum(measured.forward_flops.get(name, {}).values())
