"""Errors of the DeferredInit and Materialize layers.

Each names the operation, where it happened (the module classes being
constructed, or the qualified name of the tensor being materialized) and
what to do about it.  The catalogue with causes and fixes is in
``docs/errors.md``.
"""

from __future__ import annotations

import errno
import os


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


class ExternalTensorMutatedError(MaterializationError):
    """An outside tensor used while recording was modified in place since."""


class DeviceUnavailableError(MaterializationError):
    """The device to materialize on does not exist in this process."""


class ReplayError(MaterializationError):
    """An operation failed while being replayed."""


class AutogradMaterializationError(MaterializationError):
    """A tensor computed with autograd cannot get eager's autograd graph."""


class CheckpointError(DeferredInitError):
    """``load_checkpoint`` cannot use its source: a missing or unreadable file, a
    corrupt header, a format it does not know.  Nothing was recorded or loaded."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint, or a file its index names, does not exist.  Also a
    ``FileNotFoundError`` (``errno.ENOENT``, ``filename`` the path), as code
    written for ``torch.load`` and safetensors expects.  Nothing was recorded
    or loaded."""

    def __init__(self, message: str, filename: str | None = None):
        super().__init__(message)
        self.errno = errno.ENOENT
        self.strerror = os.strerror(errno.ENOENT)
        self.filename = filename

    def __str__(self) -> str:
        return self.args[0] if self.args else ""

    def __reduce__(self):
        return type(self), (str(self), self.filename)


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit the module: shapes differ, or (with
    ``strict=True``) keys are missing or unexpected.  Nothing was recorded or loaded."""


class CheckpointReadError(MaterializationError):
    """A checkpoint recorded by ``load_checkpoint`` could not be read while
    materializing (the file is gone, truncated or changed); nothing was changed."""


class DeferredWriteError(RecordingError):
    """A computation that is not recorded (a forward pass or an optimizer step
    on a still-deferred model outside ``fake_mode``) wrote a deferred tensor."""


class FSDP1DeferredModuleError(DeferredInitError):
    """``FullyShardedDataParallel`` (FSDP1) flattened deferred parameters it did not
    materialize: it was built outside ``deferinit.materialize.distributed.fsdp1_hooks()``,
    or its ``param_init_fn`` left them deferred."""


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
