"""Collecting what the graph view draws from a record: one item per recorded op
(placed in the module that owns it) and per tensor, and the edges between them."""

from __future__ import annotations

import torch

from ..ir.graph import Input, Node
from ..ir.plan import read_of
from ..wrappers import inner_tensors
from ..text import dtype_name
from ..view import Graph, data_closure, deferred_tensors, op_name, record_base
from .drawing import Drawing, Item, common, parent, relative, within
from .style import ALIAS_EDGE, RNG_EDGE, TENSOR_EDGE, VIEW_EDGE, WRITE_EDGE, category, node_label, scalars_text


class GraphViewError(ValueError):
    """``to_dot`` was asked for something it cannot draw (nothing deferred, no such submodule)."""


def collect(obj, *, module, depth, expand, name) -> Drawing:
    """What to draw for a module (or one of its submodules) or a tensor: an item per
    recorded op and per tensor, edges for reads, writes, views and generators."""
    root_module = None
    root = ""  # the drawn module's path
    if isinstance(obj, torch.nn.Module):
        root_module = obj
        target = obj
        if module:
            try:
                target = obj.get_submodule(module)
            except AttributeError:
                children = ", ".join(n for n, _ in obj.named_modules() if n and "." not in n) or "none"
                raise GraphViewError(
                    f"{type(obj).__name__} has no submodule {module!r} (its children: {children})"
                ) from None
            root = module
        prefix = root + "." if root else ""
        targets = [(prefix + n, f) for n, f in deferred_tensors(target)]
        kinds = _tensor_kinds(target)
        what = f"{type(obj).__name__}" + (f".{module}" if module else "")
    elif isinstance(obj, torch.Tensor):
        if module:
            raise GraphViewError("module= selects a submodule; it needs a module, not a tensor")
        targets = [(name or "tensor", f) for _, f in deferred_tensors(obj)]
        kinds = {id(f): "parameter" if isinstance(obj, torch.nn.Parameter) else "buffer" for _, f in targets}
        what = "tensor"
    else:
        raise GraphViewError(f"to_dot() expects an nn.Module or a tensor, got {type(obj).__name__}")
    if not targets:
        raise GraphViewError(
            f"the {what} has no deferred tensors to draw: build it with deferred_init, "
            "and draw it before materializing it"
        )
    # Numbered as graph_of(obj) numbers them, whatever part is drawn.
    base = record_base([f for _, f in deferred_tensors(obj)])
    d = Drawing(
        graph=Graph(targets, base=base), title=what, root_module=root_module, root=root,
        tensor_obj=not isinstance(obj, torch.nn.Module), depth=depth, expand=expand,
    )
    _build(d, targets, kinds)
    return d


def _build(d: Drawing, targets, kinds) -> None:
    graph = d.graph
    reads = [(n, f, read_of(f)) for n, f in targets]
    data = data_closure([r for _, _, r in reads])
    in_graph = {id(n) for n in graph.nodes}
    nodes = [n for n in graph.nodes if id(n) in data]
    rng_only = [n for n in graph.nodes if id(n) not in data]
    values = _values(graph.nodes, [r for _, _, r in reads])

    # Who reads what, to place unlabelled nodes with their readers.
    edges: list[tuple[Node, Node, dict]] = []
    for node in nodes:
        for pos, x in enumerate(node.flat):
            if type(x) is not Input:
                continue
            src, after = _read_sources(x, in_graph)
            if pos in node.writes:
                style = WRITE_EDGE
            elif category(node) == "view" and x is _first_input(node):
                style = VIEW_EDGE
            else:
                style = {}
            edges.append((src, node, style))
            if after is not None:
                edges.append((after, node, ALIAS_EDGE))
    readers: dict[int, list[Node]] = {}
    for src, dst, _ in edges:
        readers.setdefault(id(src), []).append(dst)

    owner: dict[int, str | None] = {}
    for node in reversed(nodes):
        labels = graph.labels.get(id(node))
        if labels:
            paths = [parent(n) for n in labels]
        else:
            paths = [owner[id(r)] for r in readers.get(id(node), ()) if owner.get(id(r)) is not None]
        if d.tensor_obj:
            owner[id(node)] = ""
        elif paths:
            p = common(paths)
            owner[id(node)] = p if within(p, d.root) else None
        else:
            outside = readers.get(id(node)) and all(owner.get(id(r)) is None for r in readers[id(node)])
            owner[id(node)] = None if outside else d.root

    for node in nodes:
        key = _node_key(node)
        d.items[f"n{node.seq}"] = Item(
            f"n{node.seq}", node_label(d.graph, node, values), category(node), owner[id(node)], key, node.seq
        )
    for src, dst, style in edges:
        d.edge(f"n{src.seq}", f"n{dst.seq}", style)

    last_seq = max((n.seq for n in nodes), default=0)
    for i, (name, fake, read) in enumerate(reads):
        src = _source(read, in_graph)
        owner_path = "" if d.tensor_obj else parent(name)
        kind = kinds.get(id(fake), "buffer")
        shape = f"[{', '.join(str(s) for s in fake.shape)}] {dtype_name(fake.dtype)} {fake.device}"
        tid = f"t{i}"
        d.items[tid] = Item(
            tid, [name, shape, kind], kind, owner_path,
            ("tensor", relative(name, owner_path), shape, kind), last_seq + 1 + i,
        )
        d.edge(f"n{src.seq}", tid, TENSOR_EDGE)

    if rng_only:
        _rng_only(d, rng_only, nodes, values)
def _rng_only(d: Drawing, rng_only, nodes, values) -> None:
    """Draws replayed only to bring a generator to the state a drawn draw needs."""
    if d.root or d.tensor_obj:
        # Outside the drawn part: one summary node.
        counts: dict[str, int] = {}
        for n in rng_only:
            if n.rng is not None:
                counts[op_name(n)] = counts.get(op_name(n), 0) + 1
        lines = [f"{sum(counts.values())} earlier random draws", "replayed for the generator state"]
        lines += [f"{k} x{v}" for k, v in sorted(counts.items())]
        d.items["rng"] = Item("rng", lines, "random", None, ("rng",), -1)
        first = next((n for n in nodes if n.rng is not None), None)
        if first is not None:
            d.edge("rng", f"n{first.seq}", RNG_EDGE)
        return
    in_graph = {id(n) for n in d.graph.nodes}
    for node in rng_only:
        label = node_label(d.graph, node, values)
        if node.rng is not None:
            label.append("(result unused: replayed for the generator)")
        d.items[f"n{node.seq}"] = Item(
            f"n{node.seq}", label, category(node), d.root, ("unused",) + _node_key(node), node.seq
        )
        for pos, x in enumerate(node.flat):
            if type(x) is Input:
                src = _source(x, in_graph)
                d.edge(f"n{src.seq}", f"n{node.seq}", WRITE_EDGE if pos in node.writes else {})


def _tensor_kinds(module: torch.nn.Module) -> dict[int, str]:
    kinds = {}
    for kind, tensors in (("buffer", module.buffers()), ("parameter", module.parameters())):
        for t in tensors:
            kinds[id(t)] = kind
            for _, inner in inner_tensors(t):  # a wrapper subclass's (DTensor's local shard)
                kinds[id(inner)] = kind
    return kinds


def _node_key(node: Node) -> tuple:
    """What a node does, without where its inputs come from (edges say that)."""
    return (node.kind, op_name(node), scalars_text(node), node.writes, node.rng is not None)


def _source(inp: Input, in_graph) -> Node:
    """The node whose result a read sees: the last write to its storage, else its creator."""
    if inp.version is not None and id(inp.version) in in_graph:
        return inp.version
    return inp.value.node


def _read_sources(inp: Input, in_graph) -> tuple[Node, Node | None]:
    """The node whose result an op reads, and the last write to the same memory
    through another alias when that write is not already upstream of it."""
    node, version = inp.value.node, inp.version
    if version is None or id(version) not in in_graph:
        return node, None
    if any(version.flat[p].value is inp.value for p in version.writes if type(version.flat[p]) is Input):
        return version, None
    if any(type(x) is Input and x.version is version for x in node.flat):
        return node, None
    return node, version


def _first_input(node: Node):
    return next((x for x in node.flat if type(x) is Input), None)


def _values(nodes, reads) -> dict:
    """``id(node) -> a Value it produced`` (the first output), for geometry in labels."""
    out = {}
    for n in nodes:
        for x in n.flat:
            if type(x) is Input and x.value.index == 0:
                out.setdefault(id(x.value.node), x.value)
    for r in reads:
        out.setdefault(id(r.value.node), r.value)
    return out
