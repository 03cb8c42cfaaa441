"""deferinit: build huge ``nn.Module`` objects without memory, replay them exactly later.

Example::

    >>> import torch
    >>> from deferinit import deferred_init, is_deferred
    >>> from deferinit.materialize import materialize_module
    >>> m = deferred_init(torch.nn.Linear, 8192, 8192, device="cuda")
    >>> is_deferred(m)
    True
    >>> m = materialize_module(m, device="cpu")   # same values as eager, on CPU
    >>> m.weight.device, is_deferred(m)
    (device(type='cpu'), False)

The same as a block::

    >>> from deferinit import deferred
    >>> with deferred():
    ...     m = torch.nn.Linear(8192, 8192, device="cuda")
    >>> is_deferred(m)
    True
"""

from .errors import (
    DataDependentError,
    DeferredInitError,
    DeferredModuleWarning,
    DeferredWriteError,
    InferenceTensorInputError,
    MaterializationError,
    MixedFakeError,
    PendingDrawsWarning,
    RecordingError,
    ReplayError,
    UnsupportedCallError,
    UnsupportedModeError,
)
from deferinit.fake import handlers

from .recorder import RECORDER
from .session import deferred, deferred_init, is_deferred
from .view import graph_of

__all__ = [
    "deferred_init",
    "deferred",
    "is_deferred",
    "graph_of",
    "to_dot",
    "materialize_module",
    "materialize_tensor",
    "AutogradMaterializationError",
    "DataDependentError",
    "DeferredInitError",
    "DeferredModuleWarning",
    "DeferredWriteError",
    "DeviceUnavailableError",
    "ExternalTensorMutatedError",
    "FSDP1DeferredModuleError",
    "InferenceTensorInputError",
    "MaterializationError",
    "MixedFakeError",
    "PendingDrawsWarning",
    "RecordingError",
    "ReplayError",
    "UnsupportedCallError",
    "UnsupportedModeError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointReadError",
]


def _evaluate(fakes, operation):
    # Values a constructor reads while recording (.item(), bool()) are
    # computed by the interpreter, which lives in the layer above; the
    # front door, which alone may know every layer, hands it to the recorder.
    from deferinit.materialize.evaluate import evaluate

    return evaluate(fakes, operation)


def _generator_state(stream, k):
    from deferinit.materialize.evaluate import generator_state

    return generator_state(stream, k)


def _explain_data_access(error, fake):
    # Data accesses that a library's idiom explains (FSDP1 flattening deferred
    # parameters it did not materialize) are named with their fix by the layer
    # that holds the fix.
    from deferinit.materialize.fsdp1 import explain_data_access

    return explain_data_access(error, fake)


def _materialize(fake):
    # data_ptr() of a deferred tensor after construction: it becomes real
    # (the recorder's address); materializing lives in the layer above.
    from deferinit.materialize import materialize_tensor

    materialize_tensor(fake)


RECORDER.evaluate = _evaluate
RECORDER.materialize = _materialize
RECORDER.generator_state = _generator_state
handlers.register_data_access_explainer(_explain_data_access)


_MATERIALIZE_ERRORS = (
    "AutogradMaterializationError", "DeviceUnavailableError", "ExternalTensorMutatedError", "FSDP1DeferredModuleError",
)
_CHECKPOINT_ERRORS = ("CheckpointError", "CheckpointMismatchError", "CheckpointNotFoundError", "CheckpointReadError")


def __getattr__(name):
    # The front door re-exports the graphviz view and the materialize layer
    # lazily: importing deferinit stays light and the layers keep pointing
    # one way (materialize -> deferinit -> fake).
    if name == "to_dot":
        from .dot import to_dot

        return to_dot
    if name in ("materialize_module", "materialize_tensor"):
        from deferinit import materialize

        return getattr(materialize, name)
    # The errors of the layers above live beside the code that raises them.
    if name in _MATERIALIZE_ERRORS:
        from deferinit.materialize import errors

        return getattr(errors, name)
    if name in _CHECKPOINT_ERRORS:
        from deferinit.materialize.checkpoint import errors

        return getattr(errors, name)
    raise AttributeError(f"module 'deferinit' has no attribute {name!r}")


from deferinit.fake.compiling import skip_compiling as _skip_compiling  # noqa: E402

_skip_compiling("deferinit")  # see fake/compiling.py
