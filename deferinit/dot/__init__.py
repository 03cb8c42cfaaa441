"""The graphviz view of a record: ``to_dot(module_or_tensor)`` and ``write(dot, path)``.

One drawn node per recorded op (``%12 aten.uniform_`` and its key scalars),
one per parameter or buffer, submodules as clusters; colours and edge
styles by kind, with a legend (docs/graph.md, "How to read it").  Identical
siblings in a ``ModuleList``/``Sequential`` are drawn once, marked ``x80``,
unless ``expand=True``; ``module="layers.3"`` draws one submodule;
``depth=N`` folds modules ``N`` levels down into one box each.

Example::

    >>> m = deferred_init(torch.nn.Embedding, 10, 4, padding_idx=0)
    >>> g = to_dot(m)            # a graphviz.Digraph
    >>> print(g.source)          # DOT text
    >>> write(g, "embedding.svg")   # needs Graphviz's `dot` program
"""

from __future__ import annotations

import pathlib

import graphviz

from .collect import GraphViewError, collect
from .emit import emit
from .style import STYLES

__all__ = [
    "FORMATS", "STYLES", "GraphFormatError", "GraphViewError", "GraphvizNotFoundError",
    "to_dot", "write",
]

INSTALL_HINT = (
    "Install Graphviz (Debian/Ubuntu: `apt-get install graphviz`; Fedora: `dnf install graphviz`; "
    "macOS: `brew install graphviz`; conda: `conda install graphviz`)"
)


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
    drawing = collect(obj, module=module, depth=depth, expand=expand, name=name)
    return emit(drawing, legend=legend, rankdir=rankdir)


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
