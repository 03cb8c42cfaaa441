"""Errors of the DeferredInit layer, and the bases the layers above derive from.

Each names the operation, where it happened (the module classes being
constructed, or the qualified name of the tensor being materialized) and
what to do about it.  ``MaterializationError`` and ``ReplayError`` live
here because this layer raises ``ReplayError`` too (``plan.py``,
``streams.py``); the Materialize layer's own errors are in
``materialize/errors.py``, the checkpoint reader's in
``materialize/checkpoint/errors.py``, and ``deferinit`` exports them all.
The catalogue with causes and fixes is in ``docs/errors.md``.
"""

from __future__ import annotations


class DeferredInitError(RuntimeError):
    """Base class of the errors raised while recording or replaying."""


class RecordingError(DeferredInitError):
    """Something inside ``deferred_init`` cannot be recorded faithfully."""


class MixedFakeError(RecordingError):
    """A fake from ``fake_mode`` (its value unknown) met a recorded tensor."""


class InferenceTensorInputError(RecordingError):
    """An inference tensor from outside was used by a recorded operation."""


class DataDependentError(RecordingError):
    """Recording needed the value of a tensor that cannot be computed now."""


class UnsupportedModeError(RecordingError):
    """A deferral was entered under a mode it cannot honour: PyTorch's own
    tracing and fake-tensor modes (``FakeTensorMode``, ``make_fx``'s proxy
    mode, functionalization), which make the tensors themselves and would see
    none of the calls the deferral records.  Nothing was entered."""


class UnsupportedCallError(RecordingError):
    """A library call that needs the real model met a deferred tensor
    (``torch.jit.trace`` runs and keeps what it computes); it names the call
    and its fix: materialize first.  Nothing was recorded."""


class MaterializationError(DeferredInitError):
    """Replaying the record failed; nothing was changed."""


class ReplayError(MaterializationError):
    """An operation failed while being replayed."""


class DeferredWriteError(RecordingError):
    """A computation that is not recorded (a forward pass or an optimizer step
    on a still-deferred model outside ``fake_mode``) wrote a deferred tensor."""


#: How FSDP1 is built on a deferred model, for the messages that point to it.
FSDP1_FIX = (
    "Build the FSDP instance inside deferinit.materialize.distributed.fsdp1_hooks(), which lets FSDP1 recognise "
    "deferred modules and materialize each unit before flattening it: "
    "`from deferinit.materialize.distributed import fsdp1_hooks, param_init_fn`, then "
    "`with fsdp1_hooks(): model = FSDP(model, param_init_fn=param_init_fn, ...)` "
    "(without param_init_fn, FSDP1 materializes each unit itself). See docs/sharded.md."
)


class DeferredModuleWarning(UserWarning):
    """A forward pass ran on a module that is still deferred, outside
    ``fake_mode``: it computed on fakes and was not recorded."""


class PendingDrawsWarning(UserWarning):
    """A real random draw from a default generator while a deferral's own draws
    from it are still pending (not yet materialized): eagerly those came first,
    so this draw and every later one from that generator differ from eager."""
