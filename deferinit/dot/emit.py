"""Emitting a drawing as DOT: clusters for modules, one Graphviz node per item,
declared so that the layout reads in recorded order."""

from __future__ import annotations

import re

import graphviz

from .drawing import Drawing, Item, parts, within
from .fold import collapse, fold_depth
from .style import FONT, STYLES, esc, label, legend_label


def emit(d: Drawing, *, legend: bool, rankdir: str) -> graphviz.Digraph:
    """The drawing as a ``graphviz.Digraph`` (folded and collapsed first)."""
    fold_depth(d)
    collapse(d)
    g = graphviz.Digraph(
        name="deferinit",
        graph_attr=dict(rankdir=rankdir, fontname=FONT, fontsize="11", compound="true", newrank="true",
                        label=esc(f"deferinit record of {d.title}"), labelloc="t"),
        node_attr=dict(shape="box", style="rounded,filled", fontname=FONT, fontsize="10", fillcolor="white"),
        edge_attr=dict(fontname=FONT, fontsize="9", arrowsize="0.7"),
    )
    by_owner: dict = {}
    for item in sorted(d.items.values(), key=lambda m: (m.seq, m.id)):
        by_owner.setdefault(item.owner, []).append(item)
    # dot orders the members of a cluster in reverse order of declaration
    # (left to right for TB), and, with rankdir LR, the members of the
    # graph itself too: declare them so that they read in recorded order.
    out = _Emitter(d, by_owner, flip=rankdir in ("LR", "RL"))
    top_items = by_owner.get(None, []) + (by_owner.get("", []) if not d.root else [])
    for item in reversed(top_items) if out.flip else top_items:
        out.item(g, item)
    paths = d.cluster_paths()
    tops = sorted(
        (p for p in paths if not any(p != q and within(p, q) for q in paths)),
        key=out.first_seq,
    )
    for top in reversed(tops) if out.flip else tops:
        out.cluster(g, top, paths)
    for (a, b), style in d.edges.items():
        if a in d.items and b in d.items:
            g.edge(a, b, **style)
    if legend:
        g.attr(label=legend_label(f"deferinit record of {d.title}"), labelloc="b")
    return g


class _Emitter:
    """Emits items and clusters into a Digraph (``flip``: declare members in reverse)."""

    def __init__(self, d: Drawing, by_owner: dict, *, flip: bool):
        self.d = d
        self.by_owner = by_owner
        self.flip = flip
        self.clusters = 0

    def first_seq(self, path) -> int:
        seqs = [m.seq for o, ms in self.by_owner.items() if o is not None and within(o, path) for m in ms]
        return min(seqs, default=0)

    def cluster(self, g, path: str, paths: set) -> None:
        children = sorted(
            (p for p in paths if p != path and within(p, path) and len(parts(p)) == len(parts(path)) + 1),
            key=self.first_seq,
        )
        cls = self.d.class_of(path)
        text = f"{path or self.d.title}" + (f" ({cls})" if cls and path else "")
        attrs = dict(label=esc(text), style="rounded", color="#9e9e9e", fontname=FONT, fontsize="11", labeljust="l")
        if path in self.d.collapsed:
            last, count = self.d.collapsed[path]
            text = f"{path} .. {last} ({cls})   x{count}"
            attrs.update(label=esc(text), style="rounded,bold", color="#1565c0", penwidth="2.5",
                         fontsize="13", fontcolor="#1565c0")
        self.clusters += 1
        with g.subgraph(name=f"cluster_{self.clusters}_" + re.sub(r"\W", "_", path)) as c:
            c.attr(**attrs)
            items = self.by_owner.get(path, [])
            for item in items if self.flip else reversed(items):
                self.item(c, item)
            for child in children if self.flip else reversed(children):
                self.cluster(c, child, paths)

    def item(self, g, item: Item) -> None:
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
            if item.box in self.d.collapsed:
                last, count = self.d.collapsed[item.box]
                item.label = [f"{item.label[0]} .. {last}   x{count}"] + item.label[1:]
                attrs.update(color="#1565c0", penwidth="2.5", fontcolor="#1565c0")
        g.node(item.id, label(item.label), **attrs)
