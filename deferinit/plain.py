"""Real tensors whose memory is not their values, and their values as a plain tensor.

A record keeps an outside tensor by reference and replay runs PyTorch's
kernels on its memory, with Python dispatch off; ``load_checkpoint`` reads a
state dict's tensors by their memory too.  A tensor subclass with a
``__torch_dispatch__`` of its own (a wrapper such as ``TwoTensor``, a
quantization library's tensor) keeps its values elsewhere: its own memory is
empty, and a kernel reading it crashes the process.  Sparse, quantized and
mkldnn tensors hold their values in layouts a strided read misreads.  Such a
tensor is read as ``copy_`` reads it (:func:`plain`), which dispatches
through the subclass exactly as eager's ``copy_`` (``load_state_dict``'s)
does, or raises as it raises.

Example::

    >>> from torch.testing._internal.two_tensor import TwoTensor
    >>> t = TwoTensor(torch.ones(2), torch.full((2,), 2.0))
    >>> dispatches_itself(t), type(plain(t)).__name__, plain(t).tolist()
    (True, 'Tensor', [2.0, 2.0])
"""

from __future__ import annotations

import torch

from deferinit.fake.bypass import no_python_dispatch

_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__


def dispatches_itself(t: torch.Tensor) -> bool:
    """Whether ``t``'s class has a ``__torch_dispatch__`` of its own (its memory
    is not where its values are)."""
    return getattr(type(t), "__torch_dispatch__", _PLAIN_DISPATCH) is not _PLAIN_DISPATCH


def holds_values(t: torch.Tensor) -> bool:
    """Whether ``t`` is a plain strided tensor (or ``nn.Parameter``) whose memory
    holds its values, elements at its offset and strides."""
    return (
        (type(t) is torch.Tensor or type(t) is torch.nn.Parameter)
        and t.layout == torch.strided
        and not (t.is_quantized or t.is_mkldnn or t.is_nested)
    )


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if it :func:`holds_values`; otherwise a new plain tensor of
    the values ``copy_`` reads from it, read now (``copy_`` raises where it
    cannot read them: a sparse tensor into a dense one)."""
    if holds_values(t):
        return t
    with torch.no_grad(), torch.inference_mode(False):
        with no_python_dispatch():  # a real tensor, also while a constructor is recorded
            out = torch.empty(tuple(t.shape), dtype=t.dtype, device=t.device)
        out.copy_(t)  # through t's own dispatch
    return out


def copied(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of ``t``'s values that nothing else refers to, made now.

    Example::

        >>> with torch.inference_mode():
        ...     t = torch.ones(2)
        >>> c = copied(t)
        >>> c.is_inference(), c.tolist()
        (False, [1.0, 1.0])
    """
    out = plain(t)
    if out is t:
        with torch.no_grad(), torch.inference_mode(False), no_python_dispatch():
            out = t.clone()
    return out
