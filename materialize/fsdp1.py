"""FSDP1 (``FullyShardedDataParallel``) on deferred modules: a ``param_init_fn``
and the hook that lets FSDP1 recognise deferred modules at all."""

from __future__ import annotations

import contextlib
import importlib
import types

import torch

from deferinit.patches import SharedPatch
from deferinit.session import is_deferred

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
_FSDP1_HOOKS = SharedPatch(
    lambda: importlib.import_module("torch.distributed.fsdp._init_utils"),
    lambda module: {"_TORCHDISTX_AVAIL": True, "fake": _FSDP1_FAKE, "deferred_init": _FSDP1_DEFERRED_INIT},
)


@contextlib.contextmanager
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
    with _FSDP1_HOOKS.held():
        yield
