"""Where in the user's code something happened: the modules being built, and
qualified names of tensors in a module.  Computed only when a message or a
printed graph needs it, never on the recording hot path."""

from __future__ import annotations

import sys

import torch


def constructing() -> str:
    """The ``nn.Module`` classes whose ``__init__`` is running, outermost first.

    Example: ``"LlamaForCausalLM > LlamaModel > LlamaDecoderLayer > LlamaMLP"``.
    """
    names = []
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "__init__":
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.nn.Module):
                name = type(owner).__name__
                if not names or names[-1] != name:
                    names.append(name)
        frame = frame.f_back
    return " > ".join(reversed(names)) if names else "(no module being constructed)"


def tensor_names(module: torch.nn.Module) -> dict[int, str]:
    """``id(tensor) -> qualified name`` for every parameter and buffer of ``module``
    (the first name of a tied tensor), DTensor local shards included."""
    names: dict[int, str] = {}
    for name, t in _named_tensors(module):
        names.setdefault(id(t), name)
        local = getattr(t, "_local_tensor", None)
        if isinstance(local, torch.Tensor):
            names.setdefault(id(local), name)
    return names


def _named_tensors(module):
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)
