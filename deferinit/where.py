"""Where in the user's code something happened: the modules being built, and
qualified names of tensors in a module.  Computed only when a message or a
printed graph needs it, never on the recording hot path.

The Python stack is read here because no protocol serves: PyTorch tells a
mode which operator runs, not which module's ``__init__``, ``forward`` or
optimizer ``step`` calls it, and the process-wide module hooks that would
(``register_module_forward_pre_hook``) would be a change of torch's global
state for the life of every deferred tensor.  :func:`training` decides
behaviour (an operation on a deferred tensor inside a forward pass is
computed on fakes with a warning, not recorded); the rest only words
messages."""

from __future__ import annotations

import sys

import torch

from deferinit.fake.calls import library_call  # noqa: F401 (re-exported)

from .random.record import current_record
from .wrappers import inner_tensors


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


def recording() -> str:
    """Where an operation on a deferred tensor happens, for messages:
    ``"while recording (constructing Llama > DecoderLayer)"`` inside
    ``deferred_init``, ``"after deferred_init returned"`` outside it."""
    if current_record() is None:
        return "after deferred_init returned"
    return f"while recording (constructing {constructing()})"


def tensor_names(module: torch.nn.Module) -> dict[int, str]:
    """``id(tensor) -> qualified name`` for every parameter and buffer of ``module``
    (the first name of a tied tensor), the inner tensors of wrapper subclasses
    (a DTensor's local shard, a quantized tensor's data) under their wrapper's."""
    names: dict[int, str] = {}
    for name, t in _named_tensors(module):
        names.setdefault(id(t), name)
        for _, inner in inner_tensors(t):
            names.setdefault(id(inner), name)
    return names


def _named_tensors(module):
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


_CALL_IMPL = frozenset({torch.nn.Module._call_impl.__code__, torch.nn.Module._wrapped_call_impl.__code__})
# A lazy module's first forward makes its parameters (``initialize_parameters``
# in a forward pre-hook): that builds the model, it does not run it.
_LAZY_INIT = torch.nn.modules.lazy.LazyModuleMixin._infer_parameters.__code__


# The Python frames of torch.jit.trace (its C++ tracer hides its state from
# Python dispatch, so the stack tells).
_TRACER = frozenset(
    getattr(torch.jit._trace, name).__code__
    for name in ("trace", "_trace_impl", "trace_module") if hasattr(torch.jit._trace, name)
)


def training() -> tuple:
    """``(module, optimizer, backward, tracer)``: the outermost ``nn.Module`` whose
    forward is running, the ``torch.optim`` optimizer whose ``step`` is
    running, whether autograd's engine is running a backward pass, and
    whether ``torch.jit.trace`` is (None/None/False/False where nothing is).

    Walks the Python stack; meant for operations on deferred tensors outside
    ``deferred_init``, never for the recording hot path.
    """
    backward = torch._C._current_graph_task_id() != -1
    module = optimizer = None
    tracer = False
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code is _LAZY_INIT:
            return None, None, backward, False
        if code in _TRACER:
            tracer = True
        if code in _CALL_IMPL or code.co_name == "forward":
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.nn.Module):
                module = owner  # the outermost one wins
        elif code.co_name == "step" and optimizer is None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.optim.Optimizer):
                optimizer = owner
        frame = frame.f_back
    return module, optimizer, backward, tracer


def tensor_name(module: torch.nn.Module, t: torch.Tensor) -> str | None:
    """``"features.1.running_mean (BatchNorm2d)"`` for a tensor of ``module``, else None."""
    name = tensor_names(module).get(id(t))
    if name is None:
        return None
    owner = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
    return f"{name} ({type(owner).__name__})"

