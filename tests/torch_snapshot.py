"""A snapshot of what deferinit could change in torch, and the differences between two.

What is compared: the attributes of ``torch``, ``torch._C``, ``torch.random``,
``torch.nn.init``, ``torch.Tensor``, ``torch._C.TensorBase``,
``torch.nn.Parameter``, ``torch.cuda``, ``torch.cuda.random`` and
``torch.utils._python_dispatch`` (its dispatch-mode flags) (by identity), the class of every ``torch`` module object, the torch-function and
dispatch mode stacks, the default device and dtype, grad, forward grad and
inference mode, the torch-function state and the thread's local dispatch keys
(what C++ guards such as ``_DisableTorchDispatch`` change).
Attributes that appear because a submodule was imported, and the lazy state
torch keeps for itself (CUDA's queued calls), are not differences.
"""

from __future__ import annotations

import gc
import sys
import types

import torch

OWNERS = {
    "torch": lambda: torch,
    "torch._C": lambda: torch._C,
    "torch.random": lambda: torch.random,
    "torch.nn.init": lambda: torch.nn.init,
    "torch.Tensor": lambda: torch.Tensor,
    "torch._C.TensorBase": lambda: torch._C.TensorBase,
    "torch.nn.Parameter": lambda: torch.nn.Parameter,
    "torch.cuda": lambda: torch.cuda,
    "torch.cuda.random": lambda: sys.modules["torch.cuda.random"],
    # the flags PyTorch keeps beside the dispatch mode stack (TorchDispatchMode.__enter__)
    "torch.utils._python_dispatch": lambda: sys.modules["torch.utils._python_dispatch"],
}

# torch's own lazy state, which torch itself changes as it goes.
_TORCH_OWN = {
    ("torch.cuda", "_queued_calls"), ("torch.cuda", "_initialized"), ("torch.cuda", "_tls"),
    ("torch.cuda", "_is_in_bad_fork"),
}


def _modes(getter):
    return tuple((id(m), type(m).__module__) for m in getter())


def take() -> dict:
    """Everything compared, now."""
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    attrs = {}
    for owner, get in OWNERS.items():
        attrs[owner] = {k: v for k, v in vars(get()).items()}
    classes = {
        name: type(m) for name, m in list(sys.modules.items())
        if m is not None and (name == "torch" or name.startswith("torch."))
    }
    return {
        "attrs": attrs,
        "classes": classes,
        "function modes": _modes(_get_current_function_mode_stack),
        "dispatch modes": _modes(_get_current_dispatch_mode_stack),
        "default device": str(torch.get_default_device()),
        "default dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "inference": torch.is_inference_mode_enabled(),
        "forward grad": torch._C._is_fwd_grad_enabled(),
        "torch function state": str(torch._C._get_torch_function_state()),
        # what a guard such as torch._C._DisableTorchDispatch leaves in the thread's dispatch keys
        "dispatch keys": (str(torch._C._dispatch_tls_local_include_set()), str(torch._C._dispatch_tls_local_exclude_set())),
        # materialization pauses Python's cyclic collector while it replays
        "garbage collector": gc.isenabled(),
    }


def differences(before: dict, after: dict) -> list[tuple]:
    """``(owner, name)`` of every attribute replaced, removed or added since
    ``before`` (besides submodules imported and torch's own lazy state), and
    ``(what, before, after)`` for the module classes, modes and defaults."""
    found = []
    for owner, old in before["attrs"].items():
        new = after["attrs"][owner]
        for name in old.keys() | new.keys():
            if (owner, name) in _TORCH_OWN:
                continue
            a, b = old.get(name, _GONE), new.get(name, _GONE)
            if a is b:
                continue
            if a is _GONE and isinstance(b, types.ModuleType):
                continue  # a submodule imported since
            found.append((owner, name))
    for name, cls in before["classes"].items():
        now = after["classes"].get(name, cls)
        if now is not cls:
            found.append((name, "__class__"))
    for name, cls in after["classes"].items():
        if name not in before["classes"] and cls is not types.ModuleType and not issubclass(cls, types.ModuleType):
            found.append((name, "__class__"))
        elif name not in before["classes"] and cls.__module__.startswith("deferinit"):
            found.append((name, "__class__"))
    for key in ("function modes", "dispatch modes", "default device", "default dtype", "grad", "inference",
                "forward grad", "torch function state", "dispatch keys", "garbage collector"):
        if before[key] != after[key]:
            found.append((key, before[key], after[key]))
    return found


_GONE = object()


# What TorchDispatchMode.__enter__ notes beside the stack: changed while our modes are active.
MODE_FLAGS = {
    ("torch.utils._python_dispatch", name) for name in (
        "_is_in_torch_dispatch_mode", "_is_in_non_infra_torch_dispatch_mode",
        "_is_in_any_mode_without_ignore_compile_internals",
    )
}


def unlisted(found: list[tuple], modes_active: bool = False) -> list[tuple]:
    """The differences that deferinit.fake.replaced.TABLE does not list (with
    ``modes_active``, PyTorch's dispatch-mode flags may differ too: looked at
    inside a recording or a fake_mode block)."""
    from deferinit.fake.replaced import RANDOM_OPS, TABLE
    from deferinit.random.pending import random_ops

    functions, methods = random_ops()
    out = []
    for item in found:
        if len(item) == 3 and item[0].endswith("modes"):
            # deferinit's own modes, pushed while a thread records or is in fake_mode
            before, after = item[1], item[2]
            if after[: len(before)] == before and all(m.startswith("deferinit") for _, m in after[len(before):]):
                continue
        if modes_active and item[0] == "dispatch keys":
            continue  # a dispatch mode pushed includes the Python keys
        if len(item) != 2:
            out.append(item)
            continue
        if modes_active and item in MODE_FLAGS:
            continue
        owner, name = item
        ok = False
        for entry in TABLE.values():
            if owner not in entry.owner:
                continue
            if entry.names == RANDOM_OPS:
                ok = name in (functions if owner == "torch" else methods)
            else:
                ok = name in entry.names
            if ok:
                break
        if not ok:
            out.append(item)
    return out
