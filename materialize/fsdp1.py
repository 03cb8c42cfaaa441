"""FSDP1 (``FullyShardedDataParallel``) on deferred modules: a ``param_init_fn``,
the hook that lets FSDP1 recognise deferred modules at all, and the error that
says so when FSDP1 was built without it."""

from __future__ import annotations

import importlib
import types

import torch

from deferinit.errors import FSDP1_FIX
from deferinit.fake.patch import shared_patch
from deferinit.session import is_deferred

from .errors import FSDP1DeferredModuleError
from .api import materialize_module


def param_init_fn(module: torch.nn.Module) -> None:
    """FSDP1's ``param_init_fn``: materialize ``module``'s own deferred parameters
    and buffers (not its children's), as ``FullyShardedDataParallel`` expects.

    FSDP1 calls it for every module of a unit before flattening the unit's
    parameters; it only calls it for modules it recognises as not yet
    initialised, so build the FSDP instance inside :func:`fsdp1_hooks`.

    Example::

        >>> model = deferred_init(Net)
        >>> with fsdp1_hooks():
        ...     model = FSDP(model, auto_wrap_policy=policy, param_init_fn=param_init_fn,
        ...                  device_id=torch.device("cpu"))
    """
    materialize_module(module, check_fn=lambda sub: sub is module)


def _fsdp1_is_fake(t) -> bool:
    return isinstance(t, torch.Tensor) and is_deferred(t)


def _fsdp1_materialize_module(module, check_fn=None):
    return materialize_module(module, check_fn=check_fn)


_FSDP1_FAKE = types.SimpleNamespace(is_fake=_fsdp1_is_fake)
_FSDP1_DEFERRED_INIT = types.SimpleNamespace(materialize_module=_fsdp1_materialize_module)
_FSDP1_HOOKS = shared_patch(
    "fsdp1 hooks", "torch.distributed.fsdp._init_utils",
    lambda: importlib.import_module("torch.distributed.fsdp._init_utils"),
    lambda module: {"_TORCHDISTX_AVAIL": True, "fake": _FSDP1_FAKE, "deferred_init": _FSDP1_DEFERRED_INIT},
)


def fsdp1_hooks():
    """Let ``FullyShardedDataParallel`` (FSDP1) recognise deferred modules.

    FSDP1 materializes a unit before flattening it only when its parameters
    are on the meta device or are torchdistX fakes.  Inside this block,
    deferinit takes torchdistX's place: FSDP1 then calls your
    ``param_init_fn`` (use :func:`param_init_fn`) for every module of a
    deferred unit, or, without one, materializes the unit with
    ``materialize_module(unit, check_fn=...)`` itself.  The hook is installed
    in ``torch.distributed.fsdp._init_utils`` for the block only (nesting and
    threads safe); wrap only the FSDP constructor in it.

    Example::

        >>> with fsdp1_hooks():
        ...     model = FSDP(deferred_init(Net), param_init_fn=param_init_fn,
        ...                  device_id=torch.device("cpu"))
    """
    return _FSDP1_HOOKS.held()  # a class-based context manager (see deferinit.fake.guard)


def explain_data_access(error, fake):
    """The error for a data or memory access on FSDP1's flat parameter made of
    deferred parameters (``FlatParamHandle.shard()`` reading its storage): FSDP1
    flattened a module it did not materialize, because it was built outside
    :func:`fsdp1_hooks` (a ``param_init_fn`` alone is never called) or its
    ``param_init_fn`` left them deferred; None for any other access.

    Example::

        >>> model = FSDP(deferred_init(Net), param_init_fn=lambda m: materialize_module(m))
        Traceback (most recent call last):
        deferinit.materialize.errors.FSDP1DeferredModuleError: FullyShardedDataParallel (FSDP1) is flattening ...
    """
    if not getattr(fake, "_is_flat_param", False):
        return None
    names = tuple(getattr(fake, "_fqns", None) or ())
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    which = f"deferred parameters ({shown})" if shown else "deferred parameters"
    init_utils = importlib.import_module("torch.distributed.fsdp._init_utils")
    if getattr(init_utils, "_TORCHDISTX_AVAIL", False):
        why = (
            "FSDP1 recognised the module as deferred, but its param_init_fn left these parameters deferred. "
            "Give param_init_fn=deferinit.materialize.distributed.param_init_fn (it materializes the module's own "
            "tensors), or leave param_init_fn out so that FSDP1 materializes each unit itself."
        )
    else:
        why = (
            "FSDP1 materializes a module before flattening it only when its parameters are on the meta "
            "device or are torchdistX fakes, so it neither called param_init_fn nor materialized them, "
            f"and sharding needs their memory. {FSDP1_FIX}"
        )
    return FSDP1DeferredModuleError(
        f"FullyShardedDataParallel (FSDP1) is flattening {which} that it did not materialize first "
        f"({error.operation} of its flat parameter). {why} FSDP1 has already replaced the module's parameters "
        "by views of its flat parameter, so build the model again (deferred_init) before wrapping it."
    )
