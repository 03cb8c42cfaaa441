"""Errors of the Materialize layer: what stops a replay on real hardware.

Each names the tensor being materialized (its qualified name in the module)
and what to do; nothing was changed when one is raised.  They derive from
the bases in :mod:`deferinit.errors` (``MaterializationError``, itself a
``DeferredInitError``), and ``deferinit`` exports them.  The catalogue with
causes and fixes is in ``docs/errors.md``.
"""

from __future__ import annotations

from deferinit.errors import DeferredInitError, MaterializationError




class ExternalTensorMutatedError(MaterializationError):
    """An outside tensor used while recording was modified in place since."""


class DeviceUnavailableError(MaterializationError):
    """The device to materialize on does not exist in this process."""


class AutogradMaterializationError(MaterializationError):
    """A tensor computed with autograd cannot get eager's autograd graph."""


class FSDP1DeferredModuleError(DeferredInitError):
    """``FullyShardedDataParallel`` (FSDP1) flattened deferred parameters it did not
    materialize: it was built outside ``deferinit.materialize.distributed.fsdp1_hooks()``,
    or its ``param_init_fn`` left them deferred."""
