"""Collectives on deferred tensors: recorded as what they compute on this rank.

``distribute_tensor`` and ``parallelize_module`` (default
``src_data_rank=0``) make every rank's shard out of rank 0's data with a
``c10d.scatter_`` (``Shard``) or ``c10d.broadcast_`` (``Replicate``).
A collective cannot be replayed, and need not be (docs/sharded.md): while
it is issued, the ranks compare a fingerprint of the source's recipe in one
small ``all_gather``; if they agree, ``broadcast_`` is recorded as nothing
and ``scatter_`` as a copy of this rank's piece of its own source (zeros
over the root's padding).  The source is found from the output, which
DTensor allocates like one of the pieces it split off the source
(``empty_like``); the pieces themselves reach the collective on the root
only.  Ranks that disagree, and any other collective on a deferred tensor,
raise :class:`CollectiveError`, on every rank at once.

Example::

    >>> torch.manual_seed(0)                       # the same seed on every rank
    >>> mlp = deferred_init(MLP)
    >>> parallelize_module(mlp, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    >>> materialize_module(mlp)                    # each shard equals eager's slice
"""

from __future__ import annotations

import hashlib

import torch

from deferinit.fake.bypass import no_python_dispatch
from deferinit.fake.dispatch import run
from deferinit.fake.extent import extent
from deferinit.fake.opinfo import bind
from deferinit.fake.tensor import FakeTensor

from .ir.effects import root_value
from .errors import RecordingError
from .ir.graph import Input
from .ir.regions import Region
from .random.rng import SAME, SEED

# Operator namespaces of collectives (ProcessGroup ops and functional collectives).
NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor"})


class CollectiveError(RecordingError):
    """A collective on deferred tensors cannot be recorded as a local operation."""


def record_collective(recorder, func, args, kwargs):
    """Record collective ``func`` on deferred fakes; the recorder calls it for every
    operator of the ``c10d`` family that touches a deferred tensor.

    Example (what ``distribute_tensor`` triggers on each rank)::

        >>> d = distribute_tensor(deferred_init(torch.randn, 8, 4), mesh, [Shard(0)])
        >>> print(graph_of(d))   # ... aten.split, aten.copy_ of this rank's piece; no c10d op
    """
    bound = bind(func, args, kwargs)
    name = func._schema.name
    if name == "c10d::broadcast_":
        return _broadcast(func, args, kwargs, bound)
    if name == "c10d::scatter_":
        return _scatter(func, args, kwargs, bound)
    raise CollectiveError(
        f"{func} on a deferred tensor: a collective needs the values of the tensors it "
        "exchanges, which do not exist before materialization. Materialize the tensors first "
        "(materialize_module / materialize_tensor), then communicate. (Only the scatter and "
        "broadcast that distribute_tensor issues are recorded, as local operations.)"
    )


def _group(boxed):
    from torch._C._distributed_c10d import ProcessGroup

    return ProcessGroup.unbox(boxed) if isinstance(boxed, torch.ScriptObject) else boxed


def _require_deferred(tensors, func) -> None:
    for t in tensors:
        if not (isinstance(t, FakeTensor) and t._record is not None):
            raise CollectiveError(
                f"{func} mixes deferred tensors with real or plain fake ones; it cannot be "
                "recorded. Materialize the deferred tensors first."
            )


def _broadcast(func, args, kwargs, bound):
    tensors = list(bound["tensors"])
    _require_deferred(tensors, func)
    group = _group(bound["process_group"])
    root = bound["root_rank"]
    mine = [fingerprint(t) for t in tensors]
    gathered = _all_gather(group, mine)
    bad = [r for r, fps in enumerate(gathered) if fps != gathered[root]]
    if bad:
        raise _disagreement("broadcast", bad, root)
    # Nothing to record: every rank already holds the root's values.
    return run(func, args, kwargs).out


def _scatter(func, args, kwargs, bound):
    outputs = list(bound["output_tensors"])
    group = _group(bound["process_group"])
    root = bound["root_rank"]
    me, size = group.rank(), group.size()
    if len(outputs) != 1:
        raise CollectiveError(f"{func} with {len(outputs)} output tensors cannot be recorded")
    out = outputs[0]
    _require_deferred([out], func)
    source, split_size, dim = _split_source(out, func)
    gathered = _all_gather(group, [fingerprint(source)])
    bad = [r for r in range(size) if gathered[r] != gathered[root]]
    if bad:
        raise _disagreement("scatter", bad, root)
    result = run(func, args, kwargs).out  # the (meta) work object; nothing recorded
    with torch.no_grad():
        pieces = torch.split(source, split_size, dim)
        n = pieces[me].shape[dim] if me < len(pieces) else 0
        # Recorded: this rank's own piece, padded with zeros as the root pads
        # it, as two writes to two parts of the output: a load of the piece
        # over the part DTensor keeps (which it views) then hides the copy,
        # and with it the source's initialization.
        if n:
            out.narrow(dim, 0, n).copy_(pieces[me])
        if out.shape[dim] > n:
            out.narrow(dim, n, out.shape[dim] - n).zero_()
    return result


# Operators DTensor applies to a piece of the split source before scattering it.
_PIECE_OPS = frozenset({"aten::clone", "aten::contiguous", "aten::constant_pad_nd", "aten::alias", "aten::detach"})


def _split_source(out: FakeTensor, func):
    """``(source, split_size, dim)``: the tensor DTensor split into the scatter's
    pieces, found from the output, which it allocates like one of the pieces
    (``empty_like``).  Raises :class:`CollectiveError` for any other pattern."""
    from deferinit.fake.flat import unflatten

    def fail(why):
        return CollectiveError(
            f"{func}: {why}, so the piece this rank receives cannot be recorded as a local "
            "operation. Pass src_data_rank=None to distribute_tensor / parallelize_module "
            "(every rank then keeps its own piece of its own copy, which is the same when "
            "every rank is seeded the same)."
        )

    node = out._value.node
    if node.kind != "op" or node.target is not torch.ops.aten.empty_like.default:
        raise fail("the output was not allocated with empty_like from a piece of the source")
    read = next((x for x in node.flat if type(x) is Input), None)
    for _ in range(16):
        if read is None:
            raise fail("the output was not allocated from a piece of the source")
        node = read.value.node
        name = node.target._schema.name if node.kind == "op" else ""
        if name in _PIECE_OPS:
            read = next((x for x in node.flat if type(x) is Input), None)
            continue
        break
    if name != "aten::split" or node.target is not torch.ops.aten.split.Tensor:
        raise fail("the pieces were not made by splitting one tensor")
    (source_read, split_size, *rest), kwargs = unflatten(list(node.flat), node.spec)
    dim = rest[0] if rest else kwargs.get("dim", 0)
    value = source_read.value
    storage = value.storage
    if storage is None or storage.head is not source_read.version:
        raise fail("the split tensor was written since")
    with no_python_dispatch():
        shadow = torch.empty(extent(value.size, value.stride, value.offset), dtype=value.dtype, device="meta").as_strided(
            value.size, value.stride, value.offset
        )
    source = FakeTensor(shadow, value.device)
    d = source.__dict__
    d["_record"] = out._record
    d["_value"] = value
    d["_storage"] = storage
    return source, split_size, dim % max(1, len(value.size))


def _all_gather(group, values: list[int]) -> list[list[int]]:
    import torch.distributed as dist

    if _backend(group) == "fake":
        # PyTorch's fake process group (one process playing one rank, for
        # simulations) exchanges nothing: trust the program to be the same.
        return [list(values) for _ in range(group.size())]
    with no_python_dispatch():
        mine = torch.tensor(values, dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in range(group.size())]
        dist.all_gather(everyone, mine, group=group)
        return [t.tolist() for t in everyone]


def _backend(group) -> str:
    import torch.distributed as dist

    try:
        return str(dist.get_backend(group))
    except (RuntimeError, ValueError, TypeError):
        return ""


def _disagreement(what: str, ranks, root) -> CollectiveError:
    return CollectiveError(
        f"distributing a deferred tensor by {what} from rank {root}: the tensor has another recipe "
        f"on rank(s) {ranks} than on rank {root} (another seed, another checkpoint loaded into it, or "
        f"rank-dependent code before it), so the values rank {root} would send cannot be reproduced "
        "there. Seed every rank the same before deferred_init and load the same checkpoint, or load "
        "the checkpoint after distribute_tensor / parallelize_module (each rank then reads its own "
        "piece), or pass src_data_rank=None to keep each rank's own values."
    )


# -- fingerprints ---------------------------------------------------------------------


def fingerprint(fake: FakeTensor) -> int:
    """A 63-bit digest of the recipe of deferred ``fake`` as it is now: equal on two
    ranks when replaying it gives the same values there.

    Example::

        >>> torch.manual_seed(0); a = deferred_init(torch.randn, 3)
        >>> torch.manual_seed(0); b = deferred_init(torch.randn, 3)
        >>> fingerprint(a) == fingerprint(b)
        True
    """
    text = repr(recipe(fake)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def recipe(fake: FakeTensor) -> list:
    """The recipe of deferred ``fake``: one tuple of plain values per node of its
    closure (inputs first), then the read of ``fake`` itself.

    Example::

        >>> recipe(deferred_init(torch.zeros, 2))
        [('op', 'aten.zeros.default', (2,), 'torch.float32', 'cpu', False), ('target', (0, 0, (2,), (1,), 0, 'torch.float32', -1))]
    """
    read = Input(fake._value, fake._storage.head)
    order = _closure(read)
    number = {id(n): i for i, n in enumerate(order)}
    items = [_describe_node(node, number) for node in order]
    items.append(("target", _describe_input(read, number)))
    return items


def _closure(read: Input) -> list:
    """The nodes ``read`` depends on, inputs before the nodes reading them, in a
    deterministic order (no recursion: write chains can be long)."""
    order: list = []
    done: set = set()
    stack = [(n, False) for n in _inputs_nodes(read)]
    while stack:
        node, expanded = stack.pop()
        if id(node) in done:
            continue
        if expanded:
            done.add(id(node))
            order.append(node)
            continue
        stack.append((node, True))
        for x in reversed(node.flat):
            if type(x) is Input:
                for dep in reversed(_inputs_nodes(x, _overwrites_storage(node))):
                    if id(dep) not in done:
                        stack.append((dep, False))
    return order


def _inputs_nodes(read: Input, overwritten: bool = False) -> list:
    if overwritten:
        return []  # only the geometry counts (described with the read)
    nodes = [read.value.node]
    if read.version is not None:
        nodes.append(read.version)
    return nodes


def _overwrites_storage(node) -> bool:
    """A checkpoint load over every byte of its storage: what was written there
    before (the initialization it replaces, maybe seeded otherwise on another
    rank) is not part of the values."""
    if node.kind != "load":
        return False
    value = node.flat[0].value
    root = root_value(value)
    if root is None:
        return False
    whole, written = Region.of(root), Region.of(value)
    return whole is None or (written is not None and written.covers(whole))


def _describe_input(read: Input, number) -> tuple:
    v = read.value
    version = number.get(id(read.version), -1) if read.version is not None else -1
    return (number.get(id(v.node), -1), v.index, v.size, v.stride, v.offset, str(v.dtype), version)


def _describe_node(node, number) -> tuple:
    parts = [node.kind, node.name]
    if node.kind in ("constant", "external"):
        parts.append(("data", _tensor_digest(node.payload), node.version))
    if node.kind == "load":
        # What the checkpoint holds, not what the file is called on this rank.
        parts.append(("loaded", node.payload.fingerprint()))
    parts.extend(_describe_arg(x, number) for x in node.flat)
    if node.rng is not None:
        parts.append(("rng", _draw_origin(node.rng[0](), node.rng[1])))
    return tuple(parts)


def _describe_arg(x, number):
    if type(x) is Input:
        return ("in", _describe_input(x, number))
    if x is None or isinstance(x, (bool, int, float, str, complex)):
        return x
    if isinstance(x, (list, tuple)):
        return tuple(_describe_arg(y, number) for y in x)
    if isinstance(x, (torch.device, torch.dtype, torch.layout, torch.memory_format)):
        return str(x)
    if isinstance(x, torch.Size):
        return tuple(x)
    return ("object", type(x).__name__)


def _draw_origin(stream, index: int) -> tuple:
    """Where the state before draw ``index`` comes from: the nearest state the
    record knows from recording (not what replays learned since, which may
    differ between ranks) and how many draws after it."""
    if stream is None:
        return ("gone",)
    key = stream.key
    key_text = str(key) if isinstance(key, torch.device) else type(key).__name__
    k, distance = index, 0
    while True:
        event = stream.events.get(k)
        if event is not None:
            kind, value = event[1], event[2]
            if kind == SAME:  # the state right after draw `value`
                k, distance = value, distance + 1
                continue
            if kind == SEED:
                return (key_text, distance, ("seed", value))
            return (key_text, distance, _tensor_digest(value))
        if k == 0:
            if stream.after is None:
                return (key_text, distance, b"")
            stream, k = stream.after, len(stream.after.nodes)
            continue
        k -= 1
        distance += 1


def _tensor_digest(t) -> bytes:
    if not isinstance(t, torch.Tensor):
        return repr(t).encode()
    with no_python_dispatch():
        data = t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(data, digest_size=8).digest() + repr((tuple(t.shape), str(t.dtype))).encode()
