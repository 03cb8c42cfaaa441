"""The tensors a module holds: parameters, buffers and plain attributes.

Constructors keep tensors outside ``_parameters`` and ``_buffers`` too:
``self.freqs = 1.0 / 10000 ** (...)`` (rotary tables in diffusers and
research code), ``weight_norm``'s computed ``weight``, lists, tuples and
dicts of tensors.  Eagerly they are real like any parameter, so
materializing a module must reach them.  The walk looks into the module's
own ``__dict__`` and, recursively, into the plain containers it holds
(``list``, ``tuple``, ``dict``, ``set`` and their subclasses), each
container once (cycles end there); it never enters submodules (they are
walked as modules), tensors, or other objects.  Tensors that other objects
hold directly in their ``__dict__`` are reported apart (``beyond``), for a
warning: they may belong to something shared, and are left alone.

A held tensor's own attributes belong to it (:func:`attached`): a class that
converts its data keeps what the conversion made there (bitsandbytes'
``Int8Params.SCB``, the ``absmax`` of a ``Params4bit``'s ``quant_state``),
and they are held with it, under its kind.
"""

from __future__ import annotations

import torch

from deferinit.fake.tensor import INTERNAL_ATTRS

_CONTAINERS = (list, tuple, dict, set, frozenset)
# Module internals walked by other means (submodules) or named otherwise.
_SKIP = frozenset({"_parameters", "_buffers", "_modules"})


class Holdings:
    """What one module (not its submodules) holds: ``(name, tensor, kind)``
    triples, ``kind`` being ``"parameter"``, ``"buffer"`` or ``"attribute"``,
    and ``beyond``: ``(name, tensor)`` pairs held by other objects one level down."""

    __slots__ = ("tensors", "beyond")

    def __init__(self):
        self.tensors: list = []
        self.beyond: list = []


def holdings(module: torch.nn.Module, prefix: str = "") -> Holdings:
    """The tensors ``module`` itself holds, named with ``prefix``.

    Example::

        >>> class Rope(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin = torch.nn.Linear(2, 2)
        ...         self.freqs = torch.arange(4.0)
        ...         self.tables = {"sin": [torch.zeros(2)], "cos": (torch.ones(2),)}
        >>> [(name, kind) for name, _, kind in holdings(Rope()).tensors]
        [('freqs', 'attribute'), ("tables['sin'][0]", 'attribute'), ("tables['cos'][0]", 'attribute')]
    """
    found = Holdings()
    dot = f"{prefix}." if prefix else ""
    for name, t in module._parameters.items():
        if t is not None:
            found.tensors.append((dot + name, t, "parameter"))
    for name, t in module._buffers.items():
        if t is not None:
            found.tensors.append((dot + name, t, "buffer"))
    seen: set = set()
    for key, value in list(vars(module).items()):
        if key not in _SKIP:
            _walk(dot + key, value, found, seen)
    for name, t, kind in list(found.tensors):
        for item_name, item in attached(t, name):
            found.tensors.append((item_name, item, kind))
    return found


# How deep the objects a tensor carries are walked (a QuantState's nested
# state2 is two levels down).
_ATTACHED_DEPTH = 3


def attached(t: torch.Tensor, name: str = "tensor") -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for the tensors ``t`` carries in its attributes: directly,
    in plain containers, and in the attributes of plain objects it holds
    (a few levels deep; modules and classes are not entered).

    Example::

        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> w.scale = torch.ones(1); w.state = type("State", (), {})(); w.state.absmax = torch.ones(1)
        >>> [n for n, _ in attached(w, "weight")]
        ['weight.scale', 'weight.state.absmax']
    """
    found: list = []
    seen: set = {id(t)}

    def visit(item_name, value, depth):
        if id(value) in seen or isinstance(value, (torch.nn.Module, type)):
            return
        if isinstance(value, torch.Tensor):
            seen.add(id(value))
            found.append((item_name, value))
            attrs(item_name, value, depth + 1)
        elif isinstance(value, _CONTAINERS):
            seen.add(id(value))
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for k, v in list(items):
                visit(f"{item_name}[{k!r}]", v, depth)
        elif depth < _ATTACHED_DEPTH:
            seen.add(id(value))
            attrs(item_name, value, depth + 1)

    def attrs(owner_name, owner, depth):
        d = getattr(owner, "__dict__", None)
        if type(d) is not dict:
            return
        for key, value in list(d.items()):
            if key not in INTERNAL_ATTRS and not isinstance(value, (int, float, str, bool, type(None))):
                visit(f"{owner_name}.{key}", value, depth)

    attrs(name, t, 0)
    return found


def _walk(name: str, value, found: Holdings, seen: set) -> None:
    if isinstance(value, torch.Tensor):
        found.tensors.append((name, value, "attribute"))
        return
    if isinstance(value, torch.nn.Module):
        return
    if isinstance(value, _CONTAINERS):
        if id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, dict):
            items = [(f"{name}[{k!r}]", v) for k, v in list(value.items())]
        elif isinstance(value, (set, frozenset)):
            items = [(f"{name}{{}}", v) for v in list(value)]
        else:
            items = [(f"{name}[{i}]", v) for i, v in enumerate(list(value))]
        for item_name, item in items:
            _walk(item_name, item, found, seen)
        return
    attrs = getattr(value, "__dict__", None)
    if type(attrs) is dict and not isinstance(value, type):
        for key, item in list(attrs.items()):
            if isinstance(item, torch.Tensor):
                found.beyond.append((f"{name}.{key}", item))


def module_tensors(module: torch.nn.Module):
    """``(qualified name, tensor, kind, submodule)`` for every tensor ``module``
    and its submodules hold (see :func:`holdings`), ties and repeats included.

    Example::

        >>> [(n, k) for n, _, k, _ in module_tensors(torch.nn.Sequential(torch.nn.Linear(1, 1)))]
        [('0.weight', 'parameter'), ('0.bias', 'parameter')]
    """
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for name, t, kind in holdings(sub, prefix).tensors:
            yield name, t, kind, sub
