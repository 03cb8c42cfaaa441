"""Folding and collapsing a drawing, so that big models stay readable.

``depth=N`` folds every module ``N`` levels below the drawn root into one
box; runs of structurally identical siblings in a ``ModuleList``,
``Sequential`` or ``ModuleDict`` (the 80 decoder layers of a 70B Llama)
are drawn once and marked ``xN``.
"""

from __future__ import annotations

import torch

from ..text import fmt_bytes, fmt_count, plural
from .drawing import Drawing, Item, parent, parts, relative, within


def fold_depth(d: Drawing) -> None:
    """``depth=N``: everything owned N levels below the root becomes one box per module."""
    if d.depth is None or d.tensor_obj:
        return
    root_depth = len(parts(d.root))
    folded: dict[str, list[Item]] = {}
    for item in list(d.items.values()):
        if item.owner is None:
            continue
        names = parts(item.owner)
        if len(names) - root_depth >= d.depth:
            box = ".".join(names[: root_depth + d.depth])
            folded.setdefault(box, []).append(item)
    rename = {}
    for number, (box, members) in enumerate(folded.items()):
        bid = f"m{number}"
        ops = [m for m in members if m.id.startswith("n")]
        tensors = [m for m in members if m.id.startswith("t")]
        counts = {c: sum(1 for m in ops if m.style == c) for c in ("random", "write", "view")}
        numel, nbytes = d.sizes(box)
        lines = [box or d.title, d.class_of(box)]
        lines.append(f"{plural(len(tensors), 'tensor')}, {fmt_count(numel, exact=False)} elements, {fmt_bytes(nbytes)}")
        lines.append(
            f"{plural(len(ops), 'op')}: {counts['random']} random, {counts['write']} in-place, "
            f"{plural(counts['view'], 'view')}"
        )
        key = ("box", tuple(m.key for m in sorted(members, key=lambda m: m.seq)), d.class_tree(box))
        seq = min(m.seq for m in members)
        d.items[bid] = Item(
            bid, [x for x in lines if x], "module", parent(box) if box != d.root else None, key, seq, box
        )
        if box == d.root:
            d.items[bid].owner = None
        for m in members:
            rename[m.id] = bid
            del d.items[m.id]
    d.rename(rename)


def collapse(d: Drawing) -> None:
    """Draw runs of identical sibling blocks once, marked xN."""
    if d.expand or d.tensor_obj or d.root_module is None:
        return
    for path in sorted(d.cluster_paths() | {d.root}, key=lambda p: len(parts(p))):
        if any(within(path, hidden) for hidden in d.hidden):
            continue
        mod = d.module(path)
        if not isinstance(mod, (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)):
            continue
        prefix = path + "." if path else ""
        children = [prefix + n for n, _ in mod.named_children()]
        incoming: dict = {}
        for (a, b), style in d.edges.items():
            incoming.setdefault(b, []).append((a, tuple(sorted(style.items()))))
        keys = [_block_key(d, c, incoming) for c in children]
        i = 0
        while i < len(children):
            j = i + 1
            while j < len(children) and keys[i] is not None and keys[j] == keys[i]:
                j += 1
            if j - i >= 2:
                _hide(d, children[i], children[i + 1 : j])
            i = j


def _block_key(d, path: str, incoming: dict):
    members = _members(d, path)
    if not members:
        return None
    position = {m.id: i for i, m in enumerate(members)}
    shape = []
    for m in members:
        ins = tuple(sorted(
            (("in", position[a]) if a in position else ("out", a), style)
            for a, style in incoming.get(m.id, ())
        ))
        owner = m.owner if m.owner is not None else "<outside>"
        shape.append((relative(owner, path), m.key, ins))
    return (d.class_tree(path), tuple(shape))


def _members(d, path: str) -> list[Item]:
    out = [
        m for m in d.items.values()
        if (m.owner is not None and within(m.owner, path)) or m.box == path
    ]
    return sorted(out, key=lambda m: (m.seq, m.id))


def _hide(d, rep: str, others: list[str]) -> None:
    rep_members = _members(d, rep)
    rename = {}
    for other in others:
        for a, b in zip(_members(d, other), rep_members):
            rename[a.id] = b.id
            del d.items[a.id]
        d.hidden.append(other)
    d.collapsed[rep] = (others[-1], len(others) + 1)
    d.rename(rename)
