"""The text inside the graph view's boxes: an op's number, name and scalar
arguments, compactly (``-0.5, 0.5``, ``[3, 4], bf16, cpu``)."""

from __future__ import annotations

import torch

from deferinit.fake.flat import unflatten

from ..ir.graph import Input, Node
from ..text import dtype_name, tensor_text
from ..view import op_name
from .style import category

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
