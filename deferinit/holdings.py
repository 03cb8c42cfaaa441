"""The tensors a module holds: parameters, buffers, plain attributes, and what other objects it holds keep.

What docs/materialize.md (``materialize_module``) lists is walked here:
the module's own ``__dict__`` and, recursively, the plain containers it holds
(``list``, ``tuple``, ``dict``, ``set`` and their subclasses), each once
(cycles end there), never entering submodules (walked as modules) or
tensors; eagerly such tensors (``self.freqs = 1.0 / 10000 ** (...)``,
``weight_norm``'s ``weight``) are real like any parameter.  Tensors other
objects keep (a hook's map of offloaded weights as accelerate's
``cpu_offload`` keeps them, a ``functools.partial`` or a closure put in
place of ``forward``) are ``beyond``: reached through objects' ``__dict__``
and ``__slots__``, partials, bound methods and closures, recursively, never
through a module, a class, a Python module or a function's globals, each
object once per walk (``seen`` may be shared by the walks of a module tree).
A deferred tensor there is a deferred tensor of the module, for
``is_deferred`` and ``materialize_module``.

A held tensor's own attributes belong to it (:func:`attached`): a class that
converts its data keeps what the conversion made there (bitsandbytes'
``Int8Params.SCB``, the ``absmax`` of a ``Params4bit``'s ``quant_state``),
and they are held with it, under its kind.
"""

from __future__ import annotations

import collections
import functools
import types

import torch

from deferinit.fake.tensor import INTERNAL_ATTRS

_CONTAINERS = (list, tuple, dict, set, frozenset)
# Module internals walked by other means (submodules) or named otherwise.
_SKIP = frozenset({"_parameters", "_buffers", "_modules"})
# Never entered: what holds no tensor of its own, or whose reach is the
# whole program (classes, Python modules, functions' globals).
_OPAQUE = (type, types.ModuleType, str, bytes, bytearray, int, float, complex, bool, type(None),
           torch.dtype, torch.device, torch.Size, torch.Generator)
# Objects entered at most this deep below the module (a hook, its weights
# map, the map's dict: 2 objects), and at most this many in one walk.
_DEPTH = 8
_BUDGET = 200_000


class Holdings:
    """What one module (not its submodules) holds: ``(name, tensor, kind)``
    triples, ``kind`` being ``"parameter"``, ``"buffer"`` or ``"attribute"``
    (the parameters and the tensors they carry first), and ``beyond``:
    ``(name, tensor)`` pairs other objects it holds keep."""

    __slots__ = ("tensors", "beyond")

    def __init__(self):
        self.tensors: list = []
        self.beyond: list = []


def holdings(module: torch.nn.Module, prefix: str = "", seen: set | None = None) -> Holdings:
    """The tensors ``module`` itself holds, named with ``prefix``.

    ``seen`` (ids of objects already walked) may be shared by the walks of
    the modules of one tree, so that an object they share is walked once.

    Example::

        >>> class Rope(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin = torch.nn.Linear(2, 2)
        ...         self.freqs = torch.arange(4.0)
        ...         self.tables = {"sin": [torch.zeros(2)], "cos": (torch.ones(2),)}
        >>> [(name, kind) for name, _, kind in holdings(Rope()).tensors]
        [('freqs', 'attribute'), ("tables['sin'][0]", 'attribute'), ("tables['cos'][0]", 'attribute')]
        >>> class Hook:
        ...     def __init__(self):
        ...         self.weights_map = {"weight": torch.ones(2)}
        >>> layer = torch.nn.Linear(2, 2); layer._hook = Hook()
        >>> [name for name, _ in holdings(layer).beyond]
        ["_hook.weights_map['weight']"]
    """
    found = Holdings()
    dot = f"{prefix}." if prefix else ""
    params = [(dot + name, t, "parameter") for name, t in module._parameters.items() if t is not None]
    found.tensors = [(dot + name, t, "buffer") for name, t in module._buffers.items() if t is not None]
    walk = _Walk(found, set() if seen is None else seen)
    for key, value in list(vars(module).items()):
        kind = type(value)
        # walk.held's first question, asked before naming the value.
        if key not in _SKIP and kind not in _EMPTY_OR_NOT and (kind not in _PLAIN or value):
            walk.held(dot + key, value)
    rest = found.tensors
    # What the tensors carry follows them, a parameter's with the parameters.
    carried: tuple = ([], [])
    for name, t, kind in params + rest:
        d = getattr(t, "__dict__", None)
        if type(d) is dict and d.keys() <= INTERNAL_ATTRS:
            continue  # attached()'s first question, asked before the call: nothing of its own
        carried[kind != "parameter"].extend((item_name, item, kind) for item_name, item in attached(t, name))
    found.tensors = params + carried[0] + rest + carried[1]
    return found


# How deep the objects a tensor carries are walked (a QuantState's nested
# state2 is two levels down).
_ATTACHED_DEPTH = 3
_SCALARS = (int, float, str, bool, type(None))


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
    _attrs(name, t, 0, found, {id(t)})
    return found


# Functions of the module, not closures: recursive closures are reference
# cycles, garbage only the cyclic collector frees (three per tensor walked).
def _visit(item_name, value, depth, found, seen):
    if id(value) in seen or isinstance(value, (torch.nn.Module, type)):
        return
    if isinstance(value, torch.Tensor):
        seen.add(id(value))
        found.append((item_name, value))
        _attrs(item_name, value, depth + 1, found, seen)
    elif isinstance(value, _CONTAINERS):
        seen.add(id(value))
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in list(items):
            _visit(f"{item_name}[{k!r}]", v, depth, found, seen)
    elif depth < _ATTACHED_DEPTH:
        seen.add(id(value))
        _attrs(item_name, value, depth + 1, found, seen)


def _attrs(owner_name, owner, depth, found, seen):
    d = getattr(owner, "__dict__", None)
    if type(d) is not dict or d.keys() <= INTERNAL_ATTRS:  # a fake's own bookkeeping only: most tensors
        return
    for key, value in list(d.items()):
        if key not in INTERNAL_ATTRS and not isinstance(value, _SCALARS):
            _visit(f"{owner_name}.{key}", value, depth, found, seen)


# Exact types that hold no tensor (the first five), or none when empty.
_EMPTY_OR_NOT = frozenset({bool, int, float, str, type(None)})
_PLAIN = _EMPTY_OR_NOT | {dict, collections.OrderedDict, list, tuple, set}


class _Walk:
    """One walk: containers of the module (``tensors``), then other objects (``beyond``)."""

    __slots__ = ("found", "seen", "containers", "budget")

    def __init__(self, found: Holdings, seen: set) -> None:
        self.found = found
        self.seen = seen
        self.containers: set = set()
        self.budget = _BUDGET

    def held(self, name: str, value) -> None:
        """What the module holds itself: tensors, and plain containers of them."""
        if type(value) in _PLAIN:
            # Most of a module's attributes (flags, sizes, empty hook maps):
            # asked first, as a model of many small modules has millions.
            if type(value) in _EMPTY_OR_NOT or not value:
                return
        if isinstance(value, torch.Tensor):
            self.found.tensors.append((name, value, "attribute"))
        elif isinstance(value, _CONTAINERS):
            if id(value) in self.containers:
                return
            self.containers.add(id(value))
            for item_name, item in _items(name, value):
                self.held(item_name, item)
        elif not isinstance(value, (torch.nn.Module, *_OPAQUE)):
            self.beyond(name, value, 1)

    def beyond(self, name: str, value, depth: int) -> None:
        """What other objects the module holds keep, ``depth`` objects down."""
        if isinstance(value, torch.Tensor):
            self.found.beyond.append((name, value))
            return
        if isinstance(value, (torch.nn.Module, *_OPAQUE)) or id(value) in self.seen:
            return
        if self.budget <= 0:
            return
        self.budget -= 1
        self.seen.add(id(value))
        if isinstance(value, _CONTAINERS):
            for item_name, item in _items(name, value):
                self.beyond(item_name, item, depth)
            return
        if depth > _DEPTH:
            return
        for key, item in _attributes(value):
            self.beyond(f"{name}.{key}", item, depth + 1)


def _items(name: str, value):
    if isinstance(value, dict):
        return [(f"{name}[{k!r}]", v) for k, v in list(value.items())]
    if isinstance(value, (set, frozenset)):
        return [(f"{name}{{}}", v) for v in list(value)]
    return [(f"{name}[{i}]", v) for i, v in enumerate(list(value))]


def _attributes(obj):
    """``(name, value)`` of what ``obj`` keeps: its ``__dict__`` and ``__slots__``,
    a partial's function and arguments, a bound method's object, a function's
    closure; read without running any ``__getattr__`` or property."""
    if isinstance(obj, functools.partial):
        return [("func", obj.func), ("args", obj.args), ("keywords", obj.keywords)]
    if isinstance(obj, types.MethodType):
        return [("__self__", obj.__self__), ("__func__", obj.__func__)]
    out = []
    if isinstance(obj, types.FunctionType):
        for var, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
            try:
                out.append((var, cell.cell_contents))
            except ValueError:  # an empty cell
                pass
    try:
        attrs = object.__getattribute__(obj, "__dict__")
    except Exception:
        attrs = None
    if type(attrs) is dict:
        out.extend(list(attrs.items()))
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if slot in ("__dict__", "__weakref__"):
                continue
            if slot.startswith("__") and not slot.endswith("__"):
                slot = f"_{cls.__name__.lstrip('_')}{slot}"  # name-mangled
            try:
                out.append((slot, object.__getattribute__(obj, slot)))
            except Exception:  # an unset slot
                pass
    return out


def module_tensors(module: torch.nn.Module):
    """``(qualified name, tensor, kind, submodule)`` for every tensor ``module``
    and its submodules hold (see :func:`holdings`), ties and repeats included;
    tensors other objects keep have the kind ``"beyond"``.

    Example::

        >>> [(n, k) for n, _, k, _ in module_tensors(torch.nn.Sequential(torch.nn.Linear(1, 1)))]
        [('0.weight', 'parameter'), ('0.bias', 'parameter')]
    """
    seen: set = set()
    for prefix, sub in module.named_modules(remove_duplicate=False):
        held = holdings(sub, prefix, seen)
        for name, t, kind in held.tensors:
            yield name, t, kind, sub
        for name, t in held.beyond:
            yield name, t, "beyond", sub
