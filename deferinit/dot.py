"""The graphviz view of a record: ``to_dot(module_or_tensor)`` and ``write(dot, path)``.

One drawn node per recorded op (``%12 aten.uniform_`` and its key scalars),
one per parameter or buffer (qualified name, shape, dtype, device), submodules
as clusters.  Factory ops, random ops, in-place writes and views are drawn
distinctly, and a legend says how:

* fill colour: factory/constant (blue), random (gold), in-place write (red),
  view (grey), other computation (white), outside tensor (grey cylinder),
  opaque Python initialiser (violet);
* edges: a solid arrow is a read, a thick red arrow the tensor an op writes
  in place, a dashed arrow the base of a view, a dotted arrow the generator
  state a random op continues from.

Big models stay readable: structurally identical siblings in a
``ModuleList``/``Sequential`` (the 80 decoder layers of a 70B Llama) are drawn
once, marked ``x80``, unless ``expand=True``; ``module="layers.3"`` draws one
submodule; ``depth=N`` folds modules ``N`` levels down into one box each.

Example::

    >>> m = deferred_init(torch.nn.Embedding, 10, 4, padding_idx=0)
    >>> g = to_dot(m)            # a graphviz.Digraph
    >>> print(g.source)          # DOT text
    >>> write(g, "embedding.svg")   # needs Graphviz's `dot` program
"""

from __future__ import annotations

import pathlib
import re
import shutil

import graphviz
import torch

from fake.flat import unflatten
from fake.opinfo import op_info

from .graph import Input, Node
from .recorder import is_deferred_fake
from .replay import read_of
from .view import Graph, deferred_tensors, dtype_name, op_name, tensor_text

# Fill colours by category, and how the legend names them.
STYLES = {
    "factory": ("#cfe2f3", "factory / constant"),
    "random": ("#ffd966", "random op"),
    "write": ("#f4a6a6", "in-place write"),
    "view": ("#e0e0e0", "view"),
    "compute": ("#ffffff", "computation"),
    "external": ("#bdbdbd", "outside tensor"),
    "opaque": ("#d5a6e6", "opaque initialiser"),
    "parameter": ("#b6e3b6", "parameter"),
    "buffer": ("#fff2cc", "buffer"),
    "module": ("#f3f3f3", "folded module"),
}
WRITE_EDGE = dict(color="#cc0000", penwidth="2.2")
VIEW_EDGE = dict(style="dashed")
RNG_EDGE = dict(style="dotted", color="#b8860b")
TENSOR_EDGE = dict(color="#2e7d32")
ALIAS_EDGE = dict(style="dotted", color="#7f7f7f")
EDGE_LEGEND = (
    ({}, "reads"),
    (WRITE_EDGE, "writes in place"),
    (VIEW_EDGE, "view of"),
    (ALIAS_EDGE, "after a write via an alias"),
    (RNG_EDGE, "continues the generator"),
    (TENSOR_EDGE, "final value"),
)
FONT = "Helvetica"

# Keyword arguments not worth a line in a node's label.
_QUIET_KWARGS = {"pin_memory", "layout", "memory_format", "non_blocking", "copy"}

INSTALL_HINT = (
    "Install Graphviz (Debian/Ubuntu: `apt-get install graphviz`; Fedora: `dnf install graphviz`; "
    "macOS: `brew install graphviz`; conda: `conda install graphviz`)"
)


class GraphViewError(ValueError):
    """``to_dot`` was asked for something it cannot draw (nothing deferred, no such submodule)."""


class GraphFormatError(ValueError):
    """``write`` was given a file name whose extension is not a format it writes."""


class GraphvizNotFoundError(RuntimeError):
    """Graphviz's ``dot`` program is missing; the DOT source was written instead.

    ``dot_path`` is where the source went.
    """

    def __init__(self, message: str, dot_path: pathlib.Path):
        super().__init__(message)
        self.dot_path = dot_path


FORMATS = ("svg", "png", "pdf", "dot", "gv")


def to_dot(
    obj,
    *,
    module: str | None = None,
    depth: int | None = None,
    expand: bool = False,
    legend: bool = True,
    rankdir: str = "LR",
    name: str | None = None,
) -> graphviz.Digraph:
    """The record behind a deferred module or tensor as a ``graphviz.Digraph``.

    ``module="layers.3"`` draws that submodule only (tensor names stay fully
    qualified; random draws outside it that its draws continue from are
    summarised in one node).  ``depth=N`` folds every module ``N`` levels
    below the drawn root into one box (``depth=0``: one box).  Identical
    sibling blocks in a ``ModuleList``/``Sequential``/``ModuleDict`` are drawn
    once and marked ``xN`` unless ``expand=True``.  ``legend=False`` leaves
    out the legend; ``rankdir="TB"`` lays the graph out top to bottom
    instead of left to right;
    ``name`` labels a tensor (default ``"tensor"``).

    Example::

        >>> m = deferred_init(torch.nn.TransformerEncoder,
        ...                   torch.nn.TransformerEncoderLayer(64, 4), num_layers=6)
        >>> g = to_dot(m)                       # layers.0 drawn once, marked x6
        >>> g = to_dot(m, module="layers.3")    # one layer
        >>> g = to_dot(m, depth=1)              # one box per child module
        >>> g.render("encoder", format="svg")   # or write(g, "encoder.svg")
    """
    if depth is not None and (not isinstance(depth, int) or depth < 0):
        raise GraphViewError(f"depth must be a non-negative integer, got {depth!r}")
    if rankdir not in ("TB", "LR", "BT", "RL"):
        raise GraphViewError(f"rankdir must be one of TB, LR, BT, RL, got {rankdir!r}")
    return _Drawing(obj, module=module, depth=depth, expand=expand, name=name).emit(legend=legend, rankdir=rankdir)


def write(dot: graphviz.Digraph, path, *, source_if_missing: bool = True) -> pathlib.Path:
    """Write ``dot`` to ``path`` in the format its extension names; return the path.

    ``.dot``/``.gv`` write the DOT source; ``.svg``, ``.png`` and ``.pdf`` are
    rendered by Graphviz's ``dot`` program.  When ``dot`` is not installed the
    source is written next to ``path`` (``.dot`` extension) and
    :class:`GraphvizNotFoundError` says so and how to install Graphviz.

    Example::

        >>> write(to_dot(deferred_init(torch.nn.Linear, 4, 2)), "linear.svg")
        PosixPath('linear.svg')
    """
    path = pathlib.Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise GraphFormatError(
            f"cannot write a graph to {str(path)!r}: the extension must be one of "
            + ", ".join("." + f for f in FORMATS)
        )
    if fmt in ("dot", "gv"):
        path.write_text(dot.source)
        return path
    try:
        data = dot.pipe(format=fmt)
    except graphviz.ExecutableNotFound:
        source = path.with_suffix(".dot")
        if source_if_missing:
            source.write_text(dot.source)
        raise GraphvizNotFoundError(
            f"Graphviz's `dot` program was not found, so {path} was not rendered; its DOT source is "
            f"in {source}. {INSTALL_HINT}, then run: dot -T{fmt} {source} -o {path}",
            source,
        ) from None
    path.write_bytes(data)
    return path


def has_dot() -> bool:
    """Whether Graphviz's ``dot`` program is on ``PATH``.

    Example::

        >>> has_dot()   # False: write(g, "x.svg") saves x.dot and says how to install Graphviz
        True
    """
    return shutil.which("dot") is not None


# -- building the drawing -------------------------------------------------------------


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _parts(path: str) -> tuple:
    return tuple(path.split(".")) if path else ()


def _common(paths) -> str:
    it = iter(paths)
    first = next(it, None)
    if first is None:
        return ""
    common = _parts(first)
    for p in it:
        parts = _parts(p)
        n = 0
        while n < len(common) and n < len(parts) and common[n] == parts[n]:
            n += 1
        common = common[:n]
    return ".".join(common)


def _within(path: str, root: str) -> bool:
    return not root or path == root or path.startswith(root + ".")


def _relative(path: str, root: str) -> str:
    if not root:
        return path
    return path[len(root) + 1 :] if path != root else ""


def category(node: Node) -> str:
    """The drawing category of a node: factory, random, write, view, compute,
    external or opaque (``constant`` counts as factory).

    Example::

        >>> [category(n) for n in graph_of(deferred_init(torch.nn.Linear, 2, 2)).nodes]
        ['factory', 'view', 'factory', 'view', 'random', 'random']
    """
    if node.kind == "constant":
        return "factory"
    if node.kind == "external":
        return "external"
    if node.kind == "opaque":
        return "opaque"
    if node.rng is not None:
        return "random"
    if node.writes:
        return "write"
    if op_info(node.target).view_arg is not None:
        return "view"
    if not any(type(x) is Input for x in node.flat):
        return "factory"
    return "compute"


class _Item:
    """Something drawn as one graphviz node: an op, a tensor, a folded module, a summary."""

    __slots__ = ("id", "label", "style", "owner", "key", "seq", "box")

    def __init__(self, id, label, style, owner, key, seq, box=None):
        self.id = id
        self.box = box  # the module path a folded-module box stands for
        self.label = label  # list of lines
        self.style = style  # category
        self.owner = owner  # module path ("" root), or None: outside the drawn module
        self.key = key  # structural description, for comparing sibling blocks
        self.seq = seq  # drawing order


class _Drawing:
    def __init__(self, obj, *, module, depth, expand, name):
        self.root_module = None
        self.root = ""  # the drawn module's path
        if isinstance(obj, torch.nn.Module):
            self.root_module = obj
            target = obj
            if module:
                try:
                    target = obj.get_submodule(module)
                except AttributeError:
                    children = ", ".join(n for n, _ in obj.named_modules() if n and "." not in n) or "none"
                    raise GraphViewError(
                        f"{type(obj).__name__} has no submodule {module!r} (its children: {children})"
                    ) from None
                self.root = module
            prefix = self.root + "." if self.root else ""
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
        self.title = what
        self.graph = Graph(targets)
        self.tensor_obj = not isinstance(obj, torch.nn.Module)
        self.depth = depth
        self.expand = expand
        self.items: dict[str, _Item] = {}
        self.edges: dict[tuple, dict] = {}
        self.collapsed: dict[str, tuple] = {}  # module path -> (last sibling path, count)
        self._hidden: list[str] = []  # module paths drawn as another (collapsed)
        self._build(targets, kinds)

    # -- ops, tensors, owners ---------------------------------------------------

    def _build(self, targets, kinds) -> None:
        graph = self.graph
        reads = [(n, f, read_of(f)) for n, f in targets]
        data = _data_closure([r for _, _, r in reads])
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
                paths = [_parent(n) for n in labels]
            else:
                paths = [owner[id(r)] for r in readers.get(id(node), ()) if owner.get(id(r)) is not None]
            if self.tensor_obj:
                owner[id(node)] = ""
            elif paths:
                p = _common(paths)
                owner[id(node)] = p if _within(p, self.root) else None
            else:
                outside = readers.get(id(node)) and all(owner.get(id(r)) is None for r in readers[id(node)])
                owner[id(node)] = None if outside else self.root

        for node in nodes:
            key = _node_key(node)
            self.items[f"n{node.seq}"] = _Item(
                f"n{node.seq}", self._node_label(node, values), category(node), owner[id(node)], key, node.seq
            )
        for src, dst, style in edges:
            self._edge(f"n{src.seq}", f"n{dst.seq}", style)

        last_seq = max((n.seq for n in nodes), default=0)
        for i, (name, fake, read) in enumerate(reads):
            src = _source(read, in_graph)
            owner_path = "" if self.tensor_obj else _parent(name)
            kind = kinds.get(id(fake), "buffer")
            shape = f"[{', '.join(str(s) for s in fake.shape)}] {dtype_name(fake.dtype)} {fake.device}"
            tid = f"t{i}"
            self.items[tid] = _Item(
                tid, [name, shape, kind], kind, owner_path,
                ("tensor", _relative(name, owner_path), shape, kind), last_seq + 1 + i,
            )
            self._edge(f"n{src.seq}", tid, TENSOR_EDGE)

        if rng_only:
            self._rng_only(rng_only, nodes, values)

    def _rng_only(self, rng_only, nodes, values) -> None:
        """Draws replayed only to bring a generator to the state a drawn draw needs."""
        if self.root or self.tensor_obj:
            # Outside the drawn part: one summary node.
            counts: dict[str, int] = {}
            for n in rng_only:
                if n.rng is not None:
                    counts[op_name(n)] = counts.get(op_name(n), 0) + 1
            lines = [f"{sum(counts.values())} earlier random draws", "replayed for the generator state"]
            lines += [f"{k} x{v}" for k, v in sorted(counts.items())]
            self.items["rng"] = _Item("rng", lines, "random", None, ("rng",), -1)
            first = next((n for n in nodes if n.rng is not None), None)
            if first is not None:
                self._edge("rng", f"n{first.seq}", RNG_EDGE)
            return
        in_graph = {id(n) for n in self.graph.nodes}
        for node in rng_only:
            label = self._node_label(node, values)
            if node.rng is not None:
                label.append("(result unused: replayed for the generator)")
            self.items[f"n{node.seq}"] = _Item(
                f"n{node.seq}", label, category(node), self.root, ("unused",) + _node_key(node), node.seq
            )
            for pos, x in enumerate(node.flat):
                if type(x) is Input:
                    src = _source(x, in_graph)
                    self._edge(f"n{src.seq}", f"n{node.seq}", WRITE_EDGE if pos in node.writes else {})

    def _edge(self, a: str, b: str, style: dict) -> None:
        self.edges.setdefault((a, b), dict(style))

    def _node_label(self, node: Node, values) -> list[str]:
        num = self.graph.name_of(node)
        if node.kind == "constant":
            return [f"{num} constant", tensor_text(node.payload) + f" {node.target}"]
        if node.kind == "external":
            t = node.payload
            return [f"{num} outside tensor", _geometry(t.shape, t.dtype, t.device), f"version {node.version}"]
        lines = [f"{num} {op_name(node)}"]
        scalars = _scalars(node)
        if scalars:
            lines.append(_clip(scalars))
        if category(node) != "factory":
            return lines
        out = values.get(id(node))
        if out is not None and not scalars.startswith("["):
            lines.append(_geometry(out.size, out.dtype, out.device))
        return lines

    # -- folding, collapsing ----------------------------------------------------

    def _fold_depth(self) -> None:
        """``depth=N``: everything owned N levels below the root becomes one box per module."""
        if self.depth is None or self.tensor_obj:
            return
        root_depth = len(_parts(self.root))
        folded: dict[str, list[_Item]] = {}
        for item in list(self.items.values()):
            if item.owner is None:
                continue
            parts = _parts(item.owner)
            if len(parts) - root_depth >= self.depth:
                box = ".".join(parts[: root_depth + self.depth])
                folded.setdefault(box, []).append(item)
        rename = {}
        for number, (box, members) in enumerate(folded.items()):
            bid = f"m{number}"
            ops = [m for m in members if m.id.startswith("n")]
            tensors = [m for m in members if m.id.startswith("t")]
            counts = {c: sum(1 for m in ops if m.style == c) for c in ("random", "write", "view")}
            numel, nbytes = self._sizes(box)
            lines = [box or self.title, self._class_of(box)]
            lines.append(f"{_plural(len(tensors), 'tensor')}, {_count(numel)} elements, {_bytes(nbytes)}")
            lines.append(
                f"{_plural(len(ops), 'op')}: {counts['random']} random, {counts['write']} in-place, "
                f"{_plural(counts['view'], 'view')}"
            )
            key = ("box", tuple(m.key for m in sorted(members, key=lambda m: m.seq)), self._class_tree(box))
            seq = min(m.seq for m in members)
            self.items[bid] = _Item(
                bid, [x for x in lines if x], "module", _parent(box) if box != self.root else None, key, seq, box
            )
            if box == self.root:
                self.items[bid].owner = None
            for m in members:
                rename[m.id] = bid
                del self.items[m.id]
        self._rename(rename)

    def _collapse(self) -> None:
        """Draw runs of identical sibling blocks once, marked xN."""
        if self.expand or self.tensor_obj or self.root_module is None:
            return
        for path in sorted(self._cluster_paths() | {self.root}, key=lambda p: len(_parts(p))):
            if any(_within(path, hidden) for hidden in self._hidden):
                continue
            mod = self._module(path)
            if not isinstance(mod, (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)):
                continue
            prefix = path + "." if path else ""
            children = [prefix + n for n, _ in mod.named_children()]
            self._incoming = {}
            for (a, b), style in self.edges.items():
                self._incoming.setdefault(b, []).append((a, tuple(sorted(style.items()))))
            keys = [self._block_key(c) for c in children]
            i = 0
            while i < len(children):
                j = i + 1
                while j < len(children) and keys[i] is not None and keys[j] == keys[i]:
                    j += 1
                if j - i >= 2:
                    self._hide(children[i], children[i + 1 : j])
                i = j

    def _block_key(self, path: str):
        members = self._members(path)
        if not members:
            return None
        position = {m.id: i for i, m in enumerate(members)}
        parts = []
        for m in members:
            ins = tuple(sorted(
                (("in", position[a]) if a in position else ("out", a), style)
                for a, style in self._incoming.get(m.id, ())
            ))
            owner = m.owner if m.owner is not None else "<outside>"
            parts.append((_relative(owner, path), m.key, ins))
        return (self._class_tree(path), tuple(parts))

    def _members(self, path: str) -> list[_Item]:
        out = [
            m for m in self.items.values()
            if (m.owner is not None and _within(m.owner, path)) or m.box == path
        ]
        return sorted(out, key=lambda m: (m.seq, m.id))

    def _hide(self, rep: str, others: list[str]) -> None:
        rep_members = self._members(rep)
        rename = {}
        for other in others:
            for a, b in zip(self._members(other), rep_members):
                rename[a.id] = b.id
                del self.items[a.id]
            self._hidden.append(other)
        self.collapsed[rep] = (others[-1], len(others) + 1)
        self._rename(rename)

    def _rename(self, rename: dict) -> None:
        if not rename:
            return
        edges: dict[tuple, dict] = {}
        for (a, b), style in self.edges.items():
            a, b = rename.get(a, a), rename.get(b, b)
            if a != b:
                edges.setdefault((a, b), style)
        self.edges = edges

    # -- modules ----------------------------------------------------------------

    def _module(self, path: str):
        if self.root_module is None:
            return None
        try:
            return self.root_module.get_submodule(path) if path else self.root_module
        except AttributeError:
            return None

    def _class_of(self, path: str) -> str:
        mod = self._module(path)
        return type(mod).__name__ if mod is not None else ""

    def _class_tree(self, path: str) -> tuple:
        mod = self._module(path)
        if mod is None:
            return ()
        return tuple((n, type(m).__name__) for n, m in mod.named_modules())

    def _sizes(self, path: str) -> tuple[int, int]:
        numel = nbytes = 0
        mod = self._module(path)
        if mod is None:
            return 0, 0
        seen = set()
        for t in list(mod.parameters()) + list(mod.buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                numel += t.numel()
                nbytes += t.numel() * t.element_size()
        return numel, nbytes

    def _cluster_paths(self) -> set[str]:
        paths = set()
        for item in self.items.values():
            if item.owner is None:
                continue
            parts = _parts(item.owner)
            for k in range(max(len(_parts(self.root)), 1), len(parts) + 1):
                paths.add(".".join(parts[:k]))
        return paths

    # -- emitting -----------------------------------------------------------------

    def emit(self, *, legend: bool, rankdir: str) -> graphviz.Digraph:
        self._fold_depth()
        self._collapse()
        g = graphviz.Digraph(
            name="deferinit",
            graph_attr=dict(rankdir=rankdir, fontname=FONT, fontsize="11", compound="true", newrank="true",
                            label=_esc(f"deferinit record of {self.title}"), labelloc="t"),
            node_attr=dict(shape="box", style="rounded,filled", fontname=FONT, fontsize="10", fillcolor="white"),
            edge_attr=dict(fontname=FONT, fontsize="9", arrowsize="0.7"),
        )
        by_owner: dict = {}
        for item in sorted(self.items.values(), key=lambda m: (m.seq, m.id)):
            by_owner.setdefault(item.owner, []).append(item)
        # dot orders the members of a cluster in reverse order of declaration
        # (left to right for TB), and, with rankdir LR, the members of the
        # graph itself too: declare them so that they read in recorded order.
        self._flip = rankdir in ("LR", "RL")
        self._clusters = 0
        top_items = by_owner.get(None, []) + (by_owner.get("", []) if not self.root else [])
        for item in reversed(top_items) if self._flip else top_items:
            self._emit_item(g, item)
        paths = self._cluster_paths()
        tops = sorted(
            (p for p in paths if not any(p != q and _within(p, q) for q in paths)),
            key=lambda p: self._first_seq(p, by_owner),
        )
        for top in reversed(tops) if self._flip else tops:
            self._emit_cluster(g, top, paths, by_owner)
        for (a, b), style in self.edges.items():
            if a in self.items and b in self.items:
                g.edge(a, b, **style)
        if legend:
            g.attr(label=_legend_label(f"deferinit record of {self.title}"), labelloc="b")
        return g

    def _first_seq(self, path, by_owner) -> int:
        seqs = [m.seq for o, ms in by_owner.items() if o is not None and _within(o, path) for m in ms]
        return min(seqs, default=0)

    def _emit_cluster(self, g, path: str, paths: set, by_owner) -> None:
        children = sorted(
            (p for p in paths if p != path and _within(p, path) and len(_parts(p)) == len(_parts(path)) + 1),
            key=lambda p: self._first_seq(p, by_owner),
        )
        cls = self._class_of(path)
        label = f"{path or self.title}" + (f" ({cls})" if cls and path else "")
        attrs = dict(label=_esc(label), style="rounded", color="#9e9e9e", fontname=FONT, fontsize="11", labeljust="l")
        if path in self.collapsed:
            last, count = self.collapsed[path]
            label = f"{path} .. {last} ({cls})   x{count}"
            attrs.update(label=_esc(label), style="rounded,bold", color="#1565c0", penwidth="2.5",
                         fontsize="13", fontcolor="#1565c0")
        self._clusters += 1
        with g.subgraph(name=f"cluster_{self._clusters}_" + re.sub(r"\W", "_", path)) as c:
            c.attr(**attrs)
            items = by_owner.get(path, [])
            for item in items if self._flip else reversed(items):
                self._emit_item(c, item)
            for child in children if self._flip else reversed(children):
                self._emit_cluster(c, child, paths, by_owner)

    def _emit_item(self, g, item: _Item) -> None:
        fill = STYLES[item.style][0]
        attrs = dict(fillcolor=fill)
        if item.style in ("parameter", "buffer"):
            attrs.update(shape="note", style="filled")
            if item.style == "buffer":
                attrs.update(style="filled,dashed")
        elif item.style == "external":
            attrs.update(shape="cylinder", style="filled")
        elif item.style == "module":
            attrs.update(shape="box3d", style="filled")
            if item.box in self.collapsed:
                last, count = self.collapsed[item.box]
                item.label = [f"{item.label[0]} .. {last}   x{count}"] + item.label[1:]
                attrs.update(color="#1565c0", penwidth="2.5", fontcolor="#1565c0")
        g.node(item.id, _label(item.label), **attrs)


def _legend_label(title: str) -> str:
    """The graph's label: its title over a compact legend (HTML-like table), drawn
    below the graph so that it takes no rank of its own."""
    cells = []
    for cat, (fill, text) in STYLES.items():
        style = ' STYLE="dashed"' if cat == "buffer" else ""
        cells.append(f'<TD BGCOLOR="{fill}"{style}>{text}</TD>')
    for style, text in EDGE_LEGEND:
        color = style.get("color", "#000000")
        glyph = _EDGE_GLYPH[style.get("style", "solid")]
        weight = ("<B>", "</B>") if "penwidth" in style else ("", "")
        cells.append(f'<TD><FONT COLOR="{color}">{weight[0]}{glyph}{weight[1]} {text}</FONT></TD>')
    per_row = 4
    rows = "".join(
        "<TR>" + "".join(cells[i : i + per_row]) + "</TR>" for i in range(0, len(cells), per_row)
    )
    return (
        '<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="2" CELLPADDING="4">'
        f'<TR><TD COLSPAN="{per_row}" BORDER="0"><B>{_html(title)}</B></TD></TR>' + rows + "</TABLE>>"
    )


def _html(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


_EDGE_GLYPH = {"solid": "&#8594;", "dashed": "- - &#8594;", "dotted": "&#183;&#183;&#183;&#8594;"}


# -- helpers ------------------------------------------------------------------------


def _tensor_kinds(module: torch.nn.Module) -> dict[int, str]:
    kinds = {}
    for kind, tensors in (("buffer", module.buffers()), ("parameter", module.parameters())):
        for t in tensors:
            fake = t if is_deferred_fake(t) else getattr(t, "_local_tensor", None)
            kinds[id(fake)] = kind
    return kinds


def _node_key(node: Node) -> tuple:
    """What a node does, without where its inputs come from (edges say that)."""
    return (node.kind, op_name(node), _scalars(node), node.writes, node.rng is not None)


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


def _data_closure(reads) -> set[int]:
    """The nodes the reads depend on by data (not only through a generator's state)."""
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


class _Hole:
    __slots__ = ()

    def __repr__(self):
        return "_"


_HOLE = _Hole()


def _scalars(node: Node) -> str:
    """The non-tensor arguments of a call, compactly (``-0.5, 0.5``, ``[3, 4], bf16, cpu``)."""
    if node.kind not in ("op", "opaque") or node.spec is None:
        return ""
    flat = [_HOLE if type(x) is Input else x for x in node.flat]
    try:
        args, kwargs = unflatten(flat, node.spec)
    except Exception:  # an unusual spec: fall back to the flat list
        args, kwargs = flat, {}
    parts = [_short(a) for a in args if a is not _HOLE and not _holes_only(a)]
    for k, v in kwargs.items():
        if v is None or k in _QUIET_KWARGS or v is _HOLE or _holes_only(v):
            continue
        if k in ("dtype", "device"):
            parts.append(_short(v))
        else:
            parts.append(f"{k}={_short(v)}")
    return ", ".join(parts)


def _holes_only(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(y is _HOLE for y in x)


def _short(x) -> str:
    if isinstance(x, torch.dtype):
        return dtype_name(x)
    if isinstance(x, float):
        return f"{x:.4g}" if x == x else "nan"
    if isinstance(x, torch.device):
        return str(x)
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join("_" if y is _HOLE else _short(y) for y in x) + "]"
    if isinstance(x, torch.Generator):
        return f"Generator({x.device})"
    if isinstance(x, torch.Tensor):
        return tensor_text(x)
    if isinstance(x, torch.memory_format):
        return str(x).replace("torch.", "")
    return repr(x)


def _geometry(shape, dtype, device) -> str:
    return f"[{', '.join(str(s) for s in shape)}] {dtype_name(dtype)} {device}"


def _clip(text: str, width: int = 44) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _esc(text: str) -> str:
    return graphviz.nohtml(text.replace("\\", "\\\\"))


def _label(lines) -> str:
    return graphviz.nohtml("\\n".join(line.replace("\\", "\\\\") for line in lines if line))


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"

