"""One training step measured by PyTorch's own trackers.

The step is what a training loop does once: forward, loss, backward (once
per micro-batch with gradient accumulation, the forward pass under
``torch.autocast`` for mixed precision), the optimizer's step,
``zero_grad``.  Memory is PyTorch's
``torch.distributed._tools.mem_tracker.MemTracker`` (``FSDPMemTracker``
for a model sharded with FSDP2), FLOPs are
``torch.utils.flop_counter.FlopCounterMode``: no accounting of our own.
On real tensors this measures the real step; inside ``deferinit.fake.fake_mode`` the
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

import contextlib
import dataclasses
import inspect
import os
import threading

import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.flop_counter import FlopCounterMode

from deferinit.cli.foreach import ChunkedForeach
from deferinit.cli.trackers import Flops, Tracker, fsdp_tracker, local_tensor
from deferinit.fake.device import backend_device
from deferinit.fake.errors import FakeDataAccessError

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

# PyTorch's trackers follow modules through global module hooks, which fire in
# every thread: two steps measured at once would count each other's modules
# (or fail in ModTracker), so steps are measured one at a time.
_one_step_at_a_time = threading.RLock()


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
    forward_flops: dict  # FlopCounterMode's counts of the forward passes: {module name: {op: flops}}
    after: dict  # like ``peak``, once the step is done: what stays between steps
    modules: list = dataclasses.field(default_factory=list)  # per micro-batch: the tracker's {module: stats}
    timeline: object = None  # the Timeline, when one was asked for
    optimizer: object = None  # set by deferinit.cli.recipe.plan_step
    recipe: list = dataclasses.field(default_factory=list)  # the recipe as text (plan_step)


def measure_step(model, args, kwargs, optimizer, *, token_ids=None, sharded: bool = False, accumulate: int = 1,
                 autocast: torch.dtype | None = None, timeline=None) -> Measured:
    """Run one training step of ``model`` under PyTorch's trackers.

    ``model(*args, **kwargs)`` is the forward pass; the loss is
    :func:`loss_of`; then ``backward()``, ``optimizer.step()`` and
    ``optimizer.zero_grad()``.  ``sharded``: the model is sharded with FSDP2
    (``FSDPMemTracker``).  ``accumulate``: gradient accumulation, the forward
    and backward passes run that many times (micro-batches of ``args``, the
    loss divided by ``accumulate``) before the optimizer's step; the trackers
    need ``reset_mod_stats()`` between micro-batches, so the per-module
    figures of each are kept in ``Measured.modules``.  ``autocast``: the
    forward pass and the loss run under ``torch.autocast`` with this dtype
    (mixed precision; the parameters stay as they are, the fp32 masters).
    ``timeline``: a :class:`~deferinit.cli.timeline.Timeline` that records
    the memory over time.  Steps measured from several threads are measured
    one after the other: PyTorch's trackers see modules through global
    module hooks, so modules another thread runs meanwhile outside
    ``measure_step`` would be counted too.
    """
    if accumulate < 1:
        raise ValueError(f"accumulate must be at least 1, got {accumulate}")
    with _one_step_at_a_time:
        return _measure(model, args, kwargs, optimizer, token_ids, sharded, accumulate, autocast, timeline)


def _measure(model, args, kwargs, optimizer, token_ids, sharded, accumulate, autocast, timeline) -> Measured:
    if sharded:
        tracker = fsdp_tracker(model, optimizer)
        tracker.timeline = timeline
        tracker.track_inputs(tuple(args) + tuple(kwargs.values()))
    else:
        tracker = Tracker()
        tracker.timeline = timeline
        tracker.track_external(model, optimizer)
    counter = Flops(tracker._mod_tracker)
    forward: dict = {}
    modules = []
    # The memory tracker inside the counter: the counter decomposes some
    # operators, and only their results are allocations of the step.
    with counter, tracker, ChunkedForeach():
        for micro in range(accumulate):
            if micro:
                modules.append(dict(tracker.memory_tracking.items()))
                tracker.reset_mod_stats()  # the trackers refuse a second forward pass of the root otherwise
            _stage(timeline, "forward", micro, accumulate)
            before = counter.get_flop_counts()
            with _autocast(model, autocast):
                loss = loss_of(model(*args, **kwargs), token_ids)
            # Per module, the forward passes' counts: in the backward pass PyTorch's
            # module tracker may hold several modules active at once (a tensor
            # several blocks read), which counts some operators more than once.
            _add_counts(forward, counter.get_flop_counts(), before)
            if accumulate > 1:
                loss = loss / accumulate
            _stage(timeline, "backward", micro, accumulate)
            loss.backward()
            del loss
        modules.append(dict(tracker.memory_tracking.items()))
        _stage(timeline, "optimizer step", 0, 1)
        with _step_reads_no_values(optimizer):
            optimizer.step()
        _stage(timeline, "zero_grad", 0, 1)
        optimizer.zero_grad()
        after = _named(tracker.get_tracker_snapshot())
    tracker.timeline = None  # the step is over: later frees (the caller's objects dying) are not part of it
    peak = _named(tracker.get_tracker_snapshot("peak"))
    return Measured(peak, counter.get_total_flops(), tracker, counter, forward, after, modules, timeline)


@contextlib.contextmanager
def _step_reads_no_values(optimizer):
    """An optimizer whose step reads a value (``p.norm(2).item()``) cannot run on
    fakes: say so, where, and what plans instead (not "materialize first",
    which a planned step cannot do)."""
    try:
        yield
    except FakeDataAccessError as e:
        cls = type(optimizer)
        step = inspect.unwrap(getattr(cls, "step", None) or (lambda: None))
        where = _frame_in(e.__traceback__, getattr(getattr(step, "__code__", None), "co_filename", None))
        raise FakeDataAccessError(
            e.operation, e.tensor_desc,
            f"{cls.__name__}.step() reads it as a Python number{where}, and in a planned step the parameters, "
            "gradients and optimizer state are fakes: shapes without values. Planning cannot run this optimizer's "
            "step; plan with one whose step computes on tensors only (--optimizer adamw, adam, sgd...). AdamW, "
            "which keeps two moments the size of each parameter, bounds the state of an optimizer keeping less.",
        ) from None


def _frame_in(tb, path) -> str:
    """`` (at file:line)`` of the innermost frame of ``tb`` in file ``path``, or ``""``."""
    found = ""
    while tb is not None and path:
        code = tb.tb_frame.f_code
        if code.co_filename == path:
            name = os.path.join(*path.split(os.sep)[-3:]) if "site-packages" in path else path
            found = f" (at {name}:{tb.tb_lineno})"
        tb = tb.tb_next
    return found


def _stage(timeline, name: str, micro: int, count: int) -> None:
    if timeline is not None:
        timeline.stage = name if count == 1 else f"{name} {micro + 1}/{count}"


def _add_counts(total: dict, now: dict, before: dict) -> None:
    for name, ops in now.items():
        had = before.get(name, {})
        mine = total.setdefault(name, {})
        for op, n in ops.items():
            if n != had.get(op, 0):
                mine[op] = mine.get(op, 0) + n - had.get(op, 0)


def _autocast(model, dtype):
    """``torch.autocast`` for the device the C++ side of the model's tensors sits
    on (CPU's for fake CUDA tensors on a build without CUDA: see
    ``deferinit.fake.device.backend_device``)."""
    if dtype is None:
        return contextlib.nullcontext()
    param = next(model.parameters(), None)
    device = local_tensor(param).device if param is not None else torch.device("cpu")
    return torch.autocast(backend_device(device).type, dtype=dtype)


def _named(snapshot) -> dict:
    return {device: {getattr(k, "name", k): v for k, v in cats.items()} for device, cats in snapshot.items()}


def module_peak(measured: Measured, module, device) -> tuple[str, dict] | None:
    """``(phase, {category: bytes, "Total": bytes})`` on ``device`` at the highest point
    while ``module`` ran (phase ``"forward"`` or ``"backward"``), or None if it never ran.

    It is the whole device's memory at that moment, not what the module owns."""
    best = None
    for state, snaps in _snapshots(measured, module):
        # MemTracker's _ModState and FSDPMemTracker's _FSDPModState name them alike.
        phase = {"PEAK_FW": "forward", "PEAK_BW": "backward"}.get(state.name)
        if phase is None:
            continue
        for snap in snaps:
            cats = snap.get(device)
            if cats is not None and (best is None or cats["Total"] > best[1]["Total"]):
                best = (phase, {getattr(k, "name", k): v for k, v in cats.items()})
    return best


def _snapshots(measured, module):
    """``(state, snapshots)`` of ``module`` over the micro-batches."""
    every = measured.modules or [measured.tracker.memory_tracking]
    for tracking in every:
        stats = tracking.get(module)
        if stats is not None:
            yield from stats.snapshots.items()


def forward_flops(measured: Measured, module=None) -> int:
    """FLOPs of the forward pass in ``module`` (the whole forward pass: None)."""
    if module is None:
        return sum(measured.forward_flops.get("Global", {}).values())
    name = measured.counter.mod_tracker._known_modules.get(module)
    return sum(measured.forward_flops.get(name, {}).values())
