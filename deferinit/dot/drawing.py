"""The drawing the graph view builds before emitting DOT: items (what becomes
one Graphviz node), edges, and the module tree they belong to.

:mod:`.collect` fills a :class:`Drawing` from a record, :mod:`.fold` folds
and collapses it, :mod:`.emit` writes it out.  Module paths are dotted
names (``"layers.3.mlp"``, ``""`` for the root).
"""

from __future__ import annotations


def parent(name: str) -> str:
    return name.rpartition(".")[0]


def parts(path: str) -> tuple:
    return tuple(path.split(".")) if path else ()


def common(paths) -> str:
    it = iter(paths)
    first = next(it, None)
    if first is None:
        return ""
    common = parts(first)
    for p in it:
        names = parts(p)
        n = 0
        while n < len(common) and n < len(names) and common[n] == names[n]:
            n += 1
        common = common[:n]
    return ".".join(common)


def within(path: str, root: str) -> bool:
    return not root or path == root or path.startswith(root + ".")


def relative(path: str, root: str) -> str:
    if not root:
        return path
    return path[len(root) + 1 :] if path != root else ""


class Item:
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


class Drawing:
    """Items and edges of one view, and the module they are drawn from.

    ``root`` is the drawn module's path inside ``root_module`` (the module
    given to ``to_dot``; None for a tensor); ``collapsed`` maps a block drawn
    for a run of identical siblings to ``(last sibling path, count)``;
    ``hidden`` lists the paths of the siblings it stands for.
    """

    def __init__(self, *, graph, title: str, root_module, root: str, tensor_obj: bool, depth, expand: bool):
        self.graph = graph
        self.title = title
        self.root_module = root_module
        self.root = root
        self.tensor_obj = tensor_obj
        self.depth = depth
        self.expand = expand
        self.items: dict[str, Item] = {}
        self.edges: dict[tuple, dict] = {}
        self.collapsed: dict[str, tuple] = {}
        self.hidden: list[str] = []

    def edge(self, a: str, b: str, style: dict) -> None:
        self.edges.setdefault((a, b), dict(style))

    def rename(self, rename: dict) -> None:
        """Point the edges of items that were merged away at the item standing for them."""
        if not rename:
            return
        edges: dict[tuple, dict] = {}
        for (a, b), style in self.edges.items():
            a, b = rename.get(a, a), rename.get(b, b)
            if a != b:
                edges.setdefault((a, b), style)
        self.edges = edges

    # -- the module tree ------------------------------------------------------

    def module(self, path: str):
        if self.root_module is None:
            return None
        try:
            return self.root_module.get_submodule(path) if path else self.root_module
        except AttributeError:
            return None

    def class_of(self, path: str) -> str:
        mod = self.module(path)
        return type(mod).__name__ if mod is not None else ""

    def class_tree(self, path: str) -> tuple:
        mod = self.module(path)
        if mod is None:
            return ()
        return tuple((n, type(m).__name__) for n, m in mod.named_modules())

    def sizes(self, path: str) -> tuple[int, int]:
        numel = nbytes = 0
        mod = self.module(path)
        if mod is None:
            return 0, 0
        seen = set()
        for t in list(mod.parameters()) + list(mod.buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                numel += t.numel()
                nbytes += t.numel() * t.element_size()
        return numel, nbytes

    def cluster_paths(self) -> set[str]:
        """The paths of the modules drawn as clusters (every module owning an item, and its parents)."""
        paths = set()
        for item in self.items.values():
            if item.owner is None:
                continue
            names = parts(item.owner)
            for k in range(max(len(parts(self.root)), 1), len(names) + 1):
                paths.add(".".join(names[:k]))
        return paths
