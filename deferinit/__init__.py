"""deferinit: build huge ``nn.Module`` objects without memory, replay them exactly later.

Example::

    >>> import torch
    >>> from deferinit import deferred_init, is_deferred
    >>> from materialize import materialize_module
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
    AutogradMaterializationError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointReadError,
    DataDependentError,
    DeferredInitError,
    DeferredModuleWarning,
    DeferredWriteError,
    DeviceUnavailableError,
    ExternalTensorMutatedError,
    InferenceTensorInputError,
    MaterializationError,
    MixedFakeError,
    RecordingError,
    ReplayError,
)
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
    "InferenceTensorInputError",
    "MaterializationError",
    "MixedFakeError",
    "RecordingError",
    "ReplayError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointReadError",
]


def _evaluate(fakes, operation):
    # Values a constructor reads while recording (.item(), bool()) are
    # computed by the interpreter, which lives in the layer above; the
    # front door, which alone may know every layer, hands it to the recorder.
    from materialize.evaluate import evaluate

    return evaluate(fakes, operation)


def _generator_state(stream, k):
    from materialize.evaluate import generator_state

    return generator_state(stream, k)


RECORDER.evaluate = _evaluate
RECORDER.generator_state = _generator_state


def __getattr__(name):
    # The front door re-exports the graphviz view and the materialize layer
    # lazily: importing deferinit stays light and the layers keep pointing
    # one way (materialize -> deferinit -> fake).
    if name == "to_dot":
        from .dot import to_dot

        return to_dot
    if name in ("materialize_module", "materialize_tensor"):
        import materialize

        return getattr(materialize, name)
    raise AttributeError(f"module 'deferinit' has no attribute {name!r}")
