"""How the graph view looks: fill colours by category, edge styles, the legend,
and escaping text for Graphviz."""

from __future__ import annotations

import graphviz

from deferinit.fake.opinfo import op_info

from ..ir.graph import Input, Node

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
