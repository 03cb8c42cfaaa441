"""How the graph view looks: fill colours by category, edge styles, the legend,
the text inside the boxes (an op's number, name and scalar arguments,
compactly: ``-0.5, 0.5``, ``[3, 4], bf16, cpu``), and escaping text for Graphviz."""

from __future__ import annotations

import graphviz
import torch

from deferinit.fake.flat import unflatten
from deferinit.fake.opinfo import op_info

from ..ir.graph import Input, Node
from ..text import dtype_name, tensor_text
from ..view import op_name

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


def legend_label(title: str) -> str:
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


def esc(text: str) -> str:
    return graphviz.nohtml(text.replace("\\", "\\\\"))


def label(lines) -> str:
    return graphviz.nohtml("\\n".join(line.replace("\\", "\\\\") for line in lines if line))


# Keyword arguments not worth a line in a node's label.
_QUIET_KWARGS = {"pin_memory", "layout", "memory_format", "non_blocking", "copy"}


def node_label(graph, node: Node, values) -> list[str]:
    """The lines drawn in an op's box: its number and name, key scalars, and the
    geometry of what a factory makes."""
    num = graph.name_of(node)
    if node.kind == "constant":
        return [f"{num} constant", tensor_text(node.payload) + f" {node.target}"]
    if node.kind == "external":
        t = node.payload
        return [f"{num} outside tensor", geometry(t.shape, t.dtype, t.device), f"version {node.version}"]
    if node.kind == "load":  # a checkpoint tensor (deferinit.materialize.checkpoint)
        entry = node.payload
        return [f"{num} load", _clip(repr(entry.key)), f"[{', '.join(str(n) for n in entry.shape)}] {dtype_name(entry.dtype)}"]
    lines = [f"{num} {op_name(node)}"]
    scalars = scalars_text(node)
    if scalars:
        lines.append(_clip(scalars))
    if category(node) != "factory":
        return lines
    out = values.get(id(node))
    if out is not None and not scalars.startswith("["):
        lines.append(geometry(out.size, out.dtype, out.device))
    return lines


class _Hole:
    __slots__ = ()

    def __repr__(self):
        return "_"


_HOLE = _Hole()


def scalars_text(node: Node) -> str:
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


def geometry(shape, dtype, device) -> str:
    return f"[{', '.join(str(s) for s in shape)}] {dtype_name(dtype)} {device}"


def _clip(text: str, width: int = 44) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
