"""What a failed ``load_checkpoint`` puts back, besides the loads it takes back.

A hook may write a module tensor in place (kept first by a :class:`Guard`),
point a tensor at other memory (``param.data = t``), swap a parameter or
buffer slot, or make a lazy placeholder a tensor (:class:`ModuleState`).
Real tensors get their values back in the memory they had (:func:`keep`,
:func:`put_back`); deferred ones get their record back as it was.

Example::

    >>> m = torch.nn.Linear(2, 2)
    >>> before = m.weight.detach().clone()
    >>> state = ModuleState(m)
    >>> m.weight.data = torch.zeros(2, 2)
    >>> state.restore()
    >>> torch.equal(m.weight, before)
    True
"""

from __future__ import annotations

import itertools

import torch

from deferinit.recorder import is_deferred_fake
from deferinit.fake import is_fake

from .capture import geometry, is_dtensor, storage_key


def keep(t: torch.Tensor) -> tuple:
    """What a real tensor holds now, for :func:`put_back`: its values, and an alias
    of its memory (a hook may point the tensor elsewhere before an undo)."""
    with torch.no_grad():
        alias = t.detach()
        return alias, alias.clone()


def put_back(head, kept) -> None:
    """Undo writes: a deferred storage's record back to ``head`` (``(storage,
    node)``), or a real tensor's memory back to what :func:`keep` kept."""
    if head is not None:
        storage, node = head
        storage.head = node
    elif kept is not None:
        alias, values = kept
        with torch.inference_mode(alias.is_inference()), torch.no_grad():
            alias.copy_(values)


class Guard:
    """A module tensor that the walk writes in place other than by a load (a hook's
    ``param[:3].copy_(x)``, ``fill_``): :meth:`undo` puts back what it held.

    Example::

        >>> m = torch.nn.Linear(2, 2)
        >>> before = m.bias.detach().clone()
        >>> guard = Guard(m.bias)
        >>> with torch.no_grad():
        ...     _ = m.bias.fill_(5.0)
        >>> guard.undo()
        >>> torch.equal(m.bias, before)
        True
    """

    def __init__(self, tensor: torch.Tensor):
        target = tensor._local_tensor if is_dtensor(tensor) else tensor
        self.target = target
        self.head = self.backup = None
        if is_deferred_fake(target):
            storage = target._storage
            self.head = (storage, storage.head)  # the record before the write
        elif not is_fake(target) and not target.is_meta:
            self.backup = keep(target)

    def undo(self) -> None:
        put_back(self.head, self.backup)
        self.head = self.backup = None


class ModuleState:
    """What the walk may change besides values, put back when the call fails: the
    parameter and buffer slots of every module, its plain tensor attributes,
    the memory each real tensor is on (a hook's ``param.data = t``), and lazy
    placeholders, which the lazy modules' pre-hook turns into tensors of the
    checkpoint's shapes.

    Example::

        >>> m = torch.nn.LazyLinear(2)
        >>> state = ModuleState(m)
        >>> m.weight.materialize((2, 3))
        >>> state.restore()
        >>> type(m.weight).__name__
        'UninitializedParameter'
    """

    def __init__(self, module: torch.nn.Module):
        self.slots = [(m, dict(m._parameters), dict(m._buffers)) for m in module.modules()]
        self.attributes = [(m, dict(vars(m))) for m in module.modules()]
        self.lazy = []
        self.memory = []
        for _, params, buffers in self.slots:
            for t in itertools.chain(params.values(), buffers.values()):
                if t is None:
                    continue
                if torch.nn.parameter.is_lazy(t):
                    self.lazy.append((t, type(t), t.data, dict(t.__dict__)))
                elif storage_key(t) is not None and not is_fake(t):
                    self.memory.append((t, t.data))

    def restore(self) -> None:
        for t, cls, data, attrs in self.lazy:
            if type(t) is not cls:
                t.data = data
                t.__class__ = cls
                t.__dict__.clear()
                t.__dict__.update(attrs)
        for t, data in self.memory:
            if storage_key(t) != storage_key(data) or geometry(t) != geometry(data):
                t.data = data
        for m, saved in self.attributes:
            for name, value in list(vars(m).items()):
                if isinstance(value, torch.Tensor) and saved.get(name) is not value:
                    if name in saved:
                        setattr(m, name, saved[name])
                    else:
                        delattr(m, name)
        for m, params, buffers in self.slots:
            for slots, saved in ((m._parameters, params), (m._buffers, buffers)):
                if slots.keys() != saved.keys() or any(slots[k] is not v for k, v in saved.items()):
                    slots.clear()
                    slots.update(saved)
