"""Reading a record: ``graph_of(module_or_tensor)`` and its text form.

Example::

    >>> print(graph_of(deferred_init(torch.nn.Linear, 4, 2)))
    %0 = aten.empty.memory_format([2, 4], dtype=torch.float32, device=cpu, pin_memory=False)  # weight
    %1 = aten.empty.memory_format([2], dtype=torch.float32, device=cpu, pin_memory=False)  # bias
    %2 = aten.uniform_(%0, -0.5, 0.5)  # weight
    %3 = aten.uniform_(%1, -0.5, 0.5)  # bias
"""

from __future__ import annotations

import torch

from deferinit.fake.flat import unflatten

from .ir.graph import Input, Node
from .ir.plan import Plan, read_of
from .text import tensor_text
from .holdings import module_tensors
from .wrappers import deferred_fakes_of


def deferred_tensors(obj) -> list[tuple[str, torch.Tensor]]:
    """``(name, deferred fake)`` pairs of a module (parameters, buffers,
    plain tensor attributes and what other objects it holds keep, the inner
    tensors of wrapper subclasses such as DTensor's local shards included,
    ties once) or of a single tensor."""
    if isinstance(obj, torch.Tensor):
        return deferred_fakes_of(obj, "tensor")
    if not isinstance(obj, torch.nn.Module):
        raise ValueError(f"expected a tensor or an nn.Module, got {type(obj).__name__}")
    seen = set()
    found = []
    for kinds in (("parameter",), ("buffer", "attribute", "beyond")):
        for name, t, kind, _ in module_tensors(obj):
            if kind not in kinds:
                continue
            for label, fake in deferred_fakes_of(t, name):
                if id(fake) not in seen:
                    seen.add(id(fake))
                    found.append((label, fake))
    return found


class Graph:
    """The recorded nodes a set of tensors needs, in recorded order, printable.

    ``nodes`` lists the nodes; ``labels`` maps ``id(node)`` to the names of
    the tensors it creates or writes; ``str(graph)`` prints one op per line.
    Get one with :func:`graph_of`.

    A node's number (``%12``) is its position in the whole record: the
    operations recorded since the outermost ``deferred_init`` (or ``with
    deferred():``) began, counted from 0, later operations on its tensors
    (``model.half()``) included.  So a node has the same number in every
    view of the record, of the whole model or of one submodule, in text or
    in :func:`deferinit.to_dot`; numbers that a view skips are operations it
    does not need.  Draws listed only because replay must redo them to bring
    a generator to the state a needed draw starts from (and the ops they
    read) are marked ``# for the generator state``.

    Example::

        >>> g = graph_of(deferred_init(torch.nn.Linear, 4, 2))
        >>> len(g), [str(n.target) for n in g.nodes][-1]
        (4, 'aten.uniform_.default')
        >>> print(g.format_node(g.nodes[-1]))
        %3 = aten.uniform_(%1, -0.5, 0.5)  # bias
    """

    def __init__(self, targets: list[tuple[str, torch.Tensor]], *, base: int | None = None):
        reads = [read_of(f) for _, f in targets]
        self.targets = targets
        # The record as written: overwritten work included (eliminate=False).
        self.nodes: list[Node] = Plan(reads, eliminate=False).order if reads else []
        self.labels: dict[int, list[str]] = {}
        for (name, fake), read in zip(targets, reads):
            for node in _history(read):
                names = self.labels.setdefault(id(node), [])
                if name not in names:
                    names.append(name)
        # Where the numbers start: the first node of the earliest record involved.
        self.base = record_base([f for _, f in targets]) if base is None else base
        self._members = {id(n) for n in self.nodes}
        data = data_closure(reads)
        self.generator_only = {id(n) for n in self.nodes if id(n) not in data}

    def __len__(self) -> int:
        return len(self.nodes)

    def name_of(self, node: Node) -> str:
        return f"%{node.seq - self.base}"

    def read_name(self, inp: Input) -> str:
        version = inp.version
        if version is not None and version.writes and id(version) in self._members:
            written = version.flat[version.writes[0]]
            if written.value is inp.value:
                return self.name_of(version)
        node = inp.value.node
        name = self.name_of(node)
        if inp.value.index:
            name += f"[{inp.value.index}]"
        return name

    def format_node(self, node: Node) -> str:
        shown = [self.read_name(x) if type(x) is Input else _Literal(_fmt(x)) for x in node.flat]
        if node.kind == "constant":
            call = f"constant({tensor_text(node.payload)}, device={node.target})"
        elif node.kind == "external":
            call = f"external({tensor_text(node.payload)}, version={node.version})"
        elif node.kind == "load":
            call = f"load({shown[0]}, {node.payload})"
        else:
            args, kwargs = unflatten(
                [s if isinstance(s, _Literal) else _Literal(s) for s in shown], node.spec
            )
            parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
            call = f"{op_name(node)}({', '.join(parts)})"
        line = f"{self.name_of(node)} = {call}"
        labels = self.labels.get(id(node))
        if labels:
            line += "  # " + ", ".join(labels)
        elif id(node) in self.generator_only:
            line += "  # for the generator state"
        return line

    def __str__(self) -> str:
        return "\n".join(self.format_node(n) for n in self.nodes)

    def __repr__(self) -> str:
        return f"<Graph of {len(self.targets)} tensors, {len(self.nodes)} nodes>"


def op_name(node: Node) -> str:
    """``aten.uniform_`` for default overloads, ``aten.add.Tensor`` otherwise."""
    if node.kind == "op":
        target = node.target
        name = f"{target.namespace}.{target._opname}"
        if target._overloadname != "default":
            name += f".{target._overloadname}"
        return name
    if node.kind == "opaque":
        return f"{node.target.__module__}.{node.target.__qualname__}"
    return node.kind


def record_base(fakes) -> int:
    """The number the node numbers of these fakes' records count from: the start
    of the earliest of their records and of the records those read from."""
    seen: dict[int, object] = {}
    stack = [f._record for f in fakes]
    while stack:
        record = stack.pop()
        if id(record) not in seen:
            seen[id(record)] = record
            stack.extend(record.parents)
    return min((r.base for r in seen.values()), default=0)


def data_closure(reads) -> set[int]:
    """``id`` of every node the reads depend on by data (not only through a
    generator's state): creators and writes, recursively."""
    seen: set[int] = set()
    stack = []
    for r in reads:
        stack.append(r.value.node)
        if r.version is not None:
            stack.append(r.version)
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for x in node.flat:
            if type(x) is Input:
                stack.append(x.value.node)
                if x.version is not None:
                    stack.append(x.version)
    return seen


def _history(read: Input):
    """The node that created a tensor's value and every node that wrote its storage since."""
    yield read.value.node
    version = read.version
    while version is not None:
        yield version
        if not version.writes:
            return
        version = version.flat[version.writes[0]].version


class _Literal:
    __slots__ = ("text",)

    def __init__(self, text):
        self.text = text

    def __repr__(self):
        return self.text


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.6g}" if x == x else "nan"
    if isinstance(x, torch.device):
        return str(x)
    if isinstance(x, (list, tuple)):
        inner = ", ".join(_fmt(y) for y in x)
        return f"[{inner}]"
    if isinstance(x, torch.Generator):
        return f"Generator(device={x.device})"
    if isinstance(x, torch.Tensor):
        return tensor_text(x)
    return repr(x)


def graph_of(obj) -> Graph:
    """The record behind a deferred module or tensor, as a printable :class:`Graph`.

    Example::

        >>> g = graph_of(deferred_init(torch.nn.Embedding, 10, 4, padding_idx=0))
        >>> print(g)
        %0 = aten.empty.memory_format([10, 4], dtype=torch.float32, device=cpu, pin_memory=False)  # weight
        %1 = aten.normal_(%0, 0, 1)  # weight
        %2 = aten.select.int(%1, 0, 0)
        %3 = aten.fill_.Scalar(%2, 0)  # weight
    """
    return Graph(deferred_tensors(obj))
