"""Python-level capture of data-dependent initialisers.

``nn.init.trunc_normal_`` (torch 2.13) samples by rejection: it loops on
``mask.any()``, so its number of draws depends on the values drawn.  It is
recorded as one opaque call instead.  The public function looks up its
worker ``_no_grad_trunc_normal_`` in ``torch.nn.init``'s globals at every
call, so replacing that global catches every route to it: ``nn.init``,
``from torch.nn.init import trunc_normal_``, transformers' and timm's
aliases.  The replacement is installed while any thread records (reference
counted under a lock) and only diverts deferred fakes; every other tensor
goes to the original.
"""

from __future__ import annotations

import functools

import torch.nn.init as _init

from deferinit.fake.patch import shared_patch

from .recorder import RECORDER, is_deferred_fake

# (global name in torch.nn.init, positional parameters after the tensor)
_TARGETS = {"_no_grad_trunc_normal_": ("mean", "std", "a", "b")}


def _diverting(name: str, original):
    params = _TARGETS[name]

    @functools.wraps(original)
    def divert(tensor, *args, **kwargs):
        if is_deferred_fake(tensor):
            bound = dict(zip(params, args))
            bound.update({k: v for k, v in kwargs.items() if k in params})
            rest = {k: v for k, v in kwargs.items() if k not in params}
            return RECORDER.opaque(original, tensor, tuple(bound[p] for p in params if p in bound), rest)
        return original(tensor, *args, **kwargs)

    divert.__deferinit_original__ = original
    return divert


def _diversions(module) -> dict:
    return {
        name: _diverting(name, getattr(module, name))
        for name in _TARGETS
        if getattr(module, name, None) is not None
    }


#: The trunc_normal_ diversion, held while any thread records.
TRUNC_NORMAL = shared_patch("trunc normal", "torch.nn.init", lambda: _init, _diversions)
