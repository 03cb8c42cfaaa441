"""The step's memory over time, as PyTorch's memory tracker counted it.

``MemTracker`` (and ``FSDPMemTracker``) keep running totals per device and
category and update them on every change: a storage allocated (``ADD``),
freed (``DEL``, when its last tensor dies), resized (``SIZE``: FSDP2's
all-gather buffers) or moved to another category (``REF``: an activation
that becomes a gradient).  A :class:`Timeline` given to
:func:`deferinit.planning.step.measure_step` records each of those updates with
the module running (the deepest one the tracker's ``ModTracker`` reports)
and the stage of the step, so the totals at any moment are those the
tracker had, and the highest of them is the tracker's peak.

From the events, :meth:`Timeline.snapshot` builds the dictionary that
``torch.cuda.memory._snapshot()`` returns on a GPU (the format of
``torch.cuda.memory._dump_snapshot``'s pickle), with one trace entry per
allocation and free: PyTorch's memory visualizer
(https://pytorch.org/memory_viz, ``torch.cuda._memory_viz``) opens it.  The
"stack" of each allocation is the module and the stage it was made in; the
addresses are made up (one after the other, 512-byte aligned, never
reused): the tracker knows sizes, not places, and no caching allocator is
simulated.
"""

from __future__ import annotations

import torch

from .step import LABELS

_ALIGN = 512
_BASE = 1 << 40  # made-up addresses start here
_ALLOC, _FREE, _RESIZE, _RECATEGORIZE = "alloc", "free", "resize", "recategorize"


def _name(key) -> str:
    return getattr(key, "name", str(key))


class Timeline:
    """Every update of a memory tracker's running totals, in order: the step's memory
    over time, given to :func:`~deferinit.planning.step.measure_step` (see
    :mod:`deferinit.planning.timeline`).

    ``events`` holds tuples ``(action, device, block, category, size,
    old, module, stage)``: ``action`` is ``"alloc"``, ``"free"``,
    ``"resize"`` (``old`` the previous size) or ``"recategorize"`` (``old``
    the previous category); ``block`` numbers the storage; ``module`` is the
    fully qualified name of the deepest module running (``""`` outside any)
    and ``stage`` the part of the step (``measure_step`` sets it).

    Example::

        >>> from deferinit.planning import measure_step
        >>> timeline = Timeline()
        >>> model = torch.nn.Linear(64, 64)
        >>> m = measure_step(model, (torch.randn(8, 64),), {}, torch.optim.SGD(model.parameters()), timeline=timeline)
        >>> max(t["Total"] for t in timeline.totals(torch.device("cpu"))) == m.peak[torch.device("cpu")]["Total"]
        True
        >>> sorted({e["action"] for e in timeline.snapshot()["device_traces"][0]})
        ['alloc', 'free_completed', 'free_requested']
    """

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.stage = "setup"
        self._blocks = 0

    def record(self, tracker, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:
        """Called by the tracker (``deferinit.planning.step``) after each update."""
        kind = u_type.name
        if kind == "ADD":
            self._blocks += 1
            winfo._timeline_block = self._blocks  # a plain object of the tracker's
            event = (_ALLOC, None)
        elif kind == "DEL":
            event = (_FREE, None)
        elif kind == "SIZE":
            event = (_RESIZE, old_mem_consumed)
        else:
            event = (_RECATEGORIZE, _name(old_reftype))
        parents = tracker._mod_tracker.parents
        module = max((p for p in parents if p != "Global"), key=lambda p: (p.count("."), p), default="")
        block = getattr(winfo, "_timeline_block", 0)
        self.events.append((event[0], winfo.device, block, _name(winfo.reftype), winfo.mem_consumed, event[1],
                            module, self.stage))

    def devices(self) -> list[torch.device]:
        """The devices with events, CUDA-like devices first."""
        return sorted({e[1] for e in self.events}, key=lambda d: (d.type == "cpu", str(d)))

    def totals(self, device: torch.device):
        """``{category: bytes, "Total": bytes}`` after each event on ``device`` (one dict per event, shared
        keys; copies)."""
        current: dict = {"Total": 0}
        for action, dev, _, category, size, old, _, _ in self.events:
            if dev != device:
                continue
            if action == _ALLOC:
                current[category] = current.get(category, 0) + size
                current["Total"] += size
            elif action == _FREE:
                current[category] = current.get(category, 0) - size
                current["Total"] -= size
            elif action == _RESIZE:
                current[category] = current.get(category, 0) + size - old
                current["Total"] += size - old
            else:
                current[old] = current.get(old, 0) - size
                current[category] = current.get(category, 0) + size
            yield dict(current)

    def snapshot(self) -> dict:
        """The events as a memory snapshot (``torch.cuda.memory._snapshot()``'s format).

        ``device_traces[i]`` holds the events of device ``i`` (CUDA devices by
        index, then the others, e.g. the CPU, after them), ``segments`` the
        blocks still allocated at the end, one segment per device.
        """
        devices = self.devices()
        index = _device_indexes(devices)
        traces: list[list] = [[] for _ in range(max(index.values(), default=-1) + 1)]
        live: dict = {}  # block -> (device index, address, size, frames)
        top = dict.fromkeys(index.values(), _BASE)
        for time, (action, dev, block, category, size, old, module, stage) in enumerate(self.events):
            i = index[dev]
            label = LABELS.get(category, category.lower())
            frames = [{"filename": module or "(no module)", "line": 0, "name": f"{stage}: {label}"}]
            if action != _ALLOC and block in live:
                # a resize or a new category: the old block goes, a new one comes
                _, addr, was, was_frames = live.pop(block)
                # MemoryViz.js colors allocations by category and needs "unknown" among the
                # categories once any is given: the frees carry it (their color is unused).
                traces[i].append(_entry("free_requested", addr, was, was_frames, time, "unknown"))
                traces[i].append(_entry("free_completed", addr, was, was_frames, time, None))
            if action != _FREE and size > 0:
                addr = top[i]
                top[i] += -(-size // _ALIGN) * _ALIGN
                live[block] = (i, addr, size, frames)
                traces[i].append(_entry("alloc", addr, size, frames, time, label))
        return {"segments": _segments(live, index), "device_traces": traces}


def _entry(action, addr, size, frames, time, category) -> dict:
    entry = {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": time, "frames": frames}
    if category is not None:
        entry["category"] = category
    return entry


def _device_indexes(devices) -> dict:
    """CUDA-like devices keep their index; the others are numbered after them."""
    index = {}
    for d in devices:
        if d.type != "cpu" and d.index is not None:
            index[d] = d.index
    after = max(index.values(), default=-1) + 1
    for d in devices:
        if d not in index:
            index[d] = after
            after += 1
    return index


def _segments(live: dict, index: dict) -> list[dict]:
    """One segment per device holding the blocks still allocated, with gaps between them."""
    segments = []
    for i in sorted(set(index.values())):
        blocks = sorted((addr, size, frames) for dev, addr, size, frames in live.values() if dev == i)
        if not blocks:
            continue
        start = last = blocks[0][0]
        out = []
        for addr, size, frames in blocks:
            if addr > last:
                out.append({"size": addr - last, "state": "inactive", "requested_size": 0, "frames": []})
            rounded = -(-size // _ALIGN) * _ALIGN
            out.append({"size": rounded, "state": "active_allocated", "requested_size": size, "frames": frames})
            last = addr + rounded
        allocated = sum(b["requested_size"] for b in out if b["state"] == "active_allocated")
        segments.append({
            "device": i, "address": start, "total_size": last - start, "stream": 0, "segment_type": "large",
            "allocated_size": allocated, "active_size": allocated, "requested_size": allocated, "blocks": out,
        })
    return segments
