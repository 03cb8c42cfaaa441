"""Operations on deferred tensors after ``deferred_init`` returned: record, or compute as fakes.

Changing a deferred model before it is real is recorded, so that
materialization replays it: sharding (``fully_shard``, ``distribute_tensor``),
``module.half()``, ``load_state_dict``, ``with torch.no_grad():
m.weight.mul_(2)``.  Running the model is not: a forward pass, a backward
pass or an optimizer step on a deferred model computes on fakes (shapes,
no values), like any fake, and leaves the record alone, since recording it
would grow the record with every batch and replay the training at
materialization.  So an operation on a deferred tensor outside
``deferred_init`` is computed as a plain fake, unrecorded, when

* a ``fake_mode`` block is open: running fakes is what it is for (planning
  memory with ``MemTracker``, FLOPs with ``FlopCounterMode``); writes
  change the fakes' shadows only;
* a module's forward, autograd's backward or an optimizer's ``step`` is
  running: the module gets a :class:`~deferinit.errors.DeferredModuleWarning`
  once, and a write to a deferred tensor raises
  :class:`~deferinit.errors.DeferredWriteError`, as it could neither be
  recorded faithfully nor silently dropped (a lazy module's parameter
  inference builds rather than runs, and is recorded: see
  :func:`deferinit.where.training`);
* an argument is a fake whose values are unknown (computed by the above):
  the result has unknown values too; writing it into a deferred tensor
  raises :class:`~deferinit.errors.DeferredWriteError`.

Everything else is recorded as before.
"""

from __future__ import annotations

import sys
import warnings
import weakref

from torch.nn import Module

from deferinit.fake.state import in_fake_mode
from deferinit.fake.tensor import FakeTensor, describe

from .errors import FSDP1_FIX, DeferredModuleWarning, DeferredWriteError
from .where import tensor_name, training

# Modules already warned about (once each).
_warned: "weakref.WeakSet" = weakref.WeakSet()


def _is_deferred(x) -> bool:
    return isinstance(x, FakeTensor) and x._record is not None


def _has_plain_fake(args, kwargs) -> bool:
    for a in (*args, *kwargs.values()):
        if isinstance(a, FakeTensor) and a._record is None:
            return True
        if type(a) in (list, tuple):
            for b in a:
                if isinstance(b, FakeTensor) and b._record is None:
                    return True
    return False


def computes_plain(func, info, args, kwargs) -> bool:
    """Whether an operation on deferred tensors, outside ``deferred_init``, is
    computed as plain fakes instead of recorded (raises for forbidden writes)."""
    if in_fake_mode():
        return True
    module, optimizer, backward = training()
    module = _compiled_from(module)
    if module is None and optimizer is None and not backward:
        if not _has_plain_fake(args, kwargs):
            return False
    if info.writes:
        for w in info.written(args, kwargs):
            if _is_deferred(w):
                raise DeferredWriteError(_write_message(func, w, module, optimizer, backward))
    if module is not None and module not in _warned:
        _warned.add(module)
        warnings.warn(_warning(module), DeferredModuleWarning, stacklevel=2)
    return True


def _compiled_from(module):
    """The model ``torch.compile(model)`` wrapped (its ``OptimizedModule`` runs
    ``model``'s forward), so that a compiled call warns as the plain one does."""
    inner = getattr(module, "_orig_mod", None) if module is not None else None
    return inner if isinstance(inner, Module) else module


def _fsdp1_fix(module) -> str | None:
    """For FSDP1 (``FullyShardedDataParallel``) wrapping a deferred module: why it did
    not materialize it and the fix; None for any other module."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    fsdp1 = getattr(fsdp, "FullyShardedDataParallel", None)
    if fsdp1 is None or not isinstance(module, fsdp1):
        return None
    return (
        "FSDP1 recognises deferred modules only inside deferinit.materialize.distributed.fsdp1_hooks(), "
        f"and did not materialize it. Build the model again (deferred_init), then: {FSDP1_FIX}"
    )


def plain_data(new, fake) -> str:
    """The message for ``fake.data = new`` outside ``deferred_init``, ``new`` a fake
    of unknown values: where such a fake comes from, and what to do."""
    module, optimizer, backward = training()
    module = _compiled_from(module)
    head = f"tensor.data = {describe(new)} on a deferred tensor {describe(fake)}: the new data "
    tail = "so its values are unknown and the deferred tensor would lose its recipe."
    if in_fake_mode():
        return (f"{head}was computed inside fake_mode, which does not record, {tail} Do this outside fake_mode "
                "(it is then recorded), create the new data inside deferred_init, or assign a real tensor.")
    if module is None and optimizer is None and not backward:
        return (f"{head}is a fake made by fake_mode (or computed from one), {tail} Assign a real tensor, or "
                "create the new data inside deferred_init.")
    fix = (_fsdp1_fix(module) if module is not None else None) or "Materialize the model first: materialize_module(model)."
    during = _during(module, optimizer, backward)
    return f"{head}was computed {during} (such a run computes on fakes and is not recorded), {tail} {fix}"


def _during(module, optimizer, backward) -> str:
    if module is not None:
        return f"during a forward pass of {type(module).__name__}, which is still deferred"
    if optimizer is not None:
        return f"during a step of {type(optimizer).__name__} on parameters that are still deferred"
    if backward:
        return "during a backward pass through a model that is still deferred"
    return "with values computed on fakes (by a forward pass of a model that is still deferred)"


def _warning(module) -> str:
    cls = type(module).__name__
    fsdp1 = _fsdp1_fix(module)
    if fsdp1 is not None:
        # One rank (NO_SHARD): FSDP1 never reads the flat parameter's memory, so
        # the missing fsdp1_hooks() shows only here.
        return (
            f"{cls} (FSDP1) wraps a module that is still deferred, so this forward pass computes on fake "
            f"tensors: {fsdp1} Shown once per module."
        )
    return (
        f"{cls} is still deferred: its parameters and buffers have no values yet, so this "
        "forward pass computes on fake tensors (shapes only) and is not recorded. Call "
        "materialize_module(model) first to compute real values, or run the pass inside "
        "deferinit.fake.fake_mode() to plan memory and FLOPs (no warning there). Shown once per module."
    )


def _write_message(func, tensor, module, optimizer, backward) -> str:
    name = tensor_name(module, tensor) if module is not None else None
    what = f"the deferred tensor {name} {describe(tensor)}" if name else f"a deferred tensor {describe(tensor)}"
    during = _during(module, optimizer, backward)
    return (
        f"{func} writes {what} {during}. Such a computation runs on fakes and is not "
        "recorded, so this write could neither be recorded faithfully nor dropped without "
        "changing what you asked for. Run the training step inside deferinit.fake.fake_mode() to plan it "
        "(writes then touch fakes only, and materialization still gives eager construction's "
        "values), or materialize the model first: materialize_module(model)."
    )
