"""No leaks: records die with their fakes, materialized modules keep nothing
of the record, and repeating deferral + materialization holds memory flat.

Measured, not eyeballed: weak references to records (``Record`` supports
them; fakes do not), counts of live graph objects found by ``gc``, a
bounded traversal of everything reachable from a module, and tracemalloc
snapshots around hundreds of iterations.
"""

from __future__ import annotations

import gc
import tracemalloc
import types
import weakref

import pytest
import torch
import torch.nn as nn

from deferinit import deferred_init
from deferinit.ir.graph import Input, Node, Storage, Value
from deferinit.random.record import Record
from deferinit.random.streams import Stream
from deferinit.fake import FakeTensor
from deferinit.materialize import materialize_module, materialize_tensor

GRAPH_TYPES = (Node, Value, Storage, Input, Record, Stream)

pytestmark = pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")


class ViewsAndRandom(nn.Module):
    """Views registered beside their base, random ops, trunc_normal_, .item()."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(6, 4))
        nn.init.trunc_normal_(self.weight, std=0.02)
        base = torch.randn(4, 4)
        self.register_buffer("base", base)
        self.register_buffer("diag", base.diagonal())
        base[0].uniform_()
        self.scale = float(torch.linspace(0, 1, 3)[1].item())
        self.bias = nn.Parameter(torch.zeros(6).add_(self.scale))
        scratch = torch.rand(5)  # a random temporary nothing keeps
        self.register_buffer("mask", scratch > 2)


def small_transformer():
    return nn.Transformer(d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                          dim_feedforward=16, dropout=0.0)


def _live_graph_objects() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) in GRAPH_TYPES)


def _record_of(module) -> Record:
    for t in list(module.parameters()) + list(module.buffers()):
        record = t.__dict__.get("_record")
        if record is not None:
            return record
    raise AssertionError("no deferred tensor in module")


# -- the record of a dropped deferred module is freed -------------------------


def test_dropped_deferred_module_frees_its_record_without_gc():
    """No reference cycles: dropping the module frees the record at once."""
    m = deferred_init(nn.Linear, 8, 8)
    ref = weakref.ref(_record_of(m))
    gc.disable()
    try:
        del m
        assert ref() is None, "the record outlived its module (a reference cycle?)"
    finally:
        gc.enable()


@pytest.mark.parametrize("ctor", ["ViewsAndRandom", "small_transformer", "linears"])
def test_materialization_makes_no_cyclic_garbage(ctor):
    """Materialization pauses the cyclic collector; garbage in cycles it makes
    would pile up until the pause ends, and the first collection after it
    would walk all of it (800,000 objects for 50,000 small parameters, when
    the holdings walk made recursive closures per tensor)."""
    make = {"ViewsAndRandom": ViewsAndRandom, "small_transformer": small_transformer,
            "linears": lambda: nn.Sequential(*[nn.Linear(4, 4) for _ in range(20)])}[ctor]
    m = deferred_init(make)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        materialize_module(m)
        gc.collect()
        # Ours: objects of the project's classes and its functions' closures.
        # (Cycles of other code the materialization lets go of do not count:
        # after the planner's doctests, hooks a ModTracker left on tensors
        # that autograd's C++ nodes keep until then.)
        ours = [o for o in gc.garbage if _of_the_project(o)]
        assert not ours, f"{len(ours)} objects in cycles, e.g. {ours[:5]}"
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def _of_the_project(o) -> bool:
    if isinstance(o, types.CellType):
        try:
            o = o.cell_contents
        except ValueError:
            return False
    module = getattr(o, "__module__", None) if isinstance(o, types.FunctionType) else type(o).__module__
    return (module or "").startswith("deferinit")


def test_dropped_deferred_module_frees_its_record():
    for ctor in (ViewsAndRandom, small_transformer):
        m = deferred_init(ctor)
        ref = weakref.ref(_record_of(m))
        del m
        gc.collect()
        assert ref() is None, f"the record of a dropped {ctor.__name__} is still alive"


def test_dropped_partly_materialized_module_frees_its_record():
    m = deferred_init(ViewsAndRandom)
    ref = weakref.ref(_record_of(m))
    materialize_tensor(m.diag)
    assert ref() is not None  # the other fakes still need it
    del m
    gc.collect()
    assert ref() is None


def test_record_lives_while_one_fake_needs_it():
    m = deferred_init(ViewsAndRandom)
    ref = weakref.ref(_record_of(m))
    weight = m.weight
    del m
    gc.collect()
    assert ref() is not None
    materialize_tensor(weight)  # still exact after the module is gone
    del weight
    gc.collect()
    assert ref() is None


def test_graph_objects_do_not_accumulate():
    baseline = _live_graph_objects()
    for _ in range(20):
        m = deferred_init(ViewsAndRandom)
        del m
    assert _live_graph_objects() <= baseline


# -- after materialization nothing of the record stays reachable -------------


def _reachable_offenders(root, limit=200_000):
    """Graph objects, records and fakes reachable from ``root`` through instances
    (types, modules, functions and code are not followed: they reach everything)."""
    skip = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
            types.CodeType, types.MethodType, types.FrameType)
    seen = set()
    stack = [root]
    offenders = []
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        if len(seen) > limit:
            raise AssertionError("traversal too large")
        if isinstance(obj, GRAPH_TYPES) or isinstance(obj, FakeTensor):
            offenders.append(obj)
            continue
        if isinstance(obj, torch.Tensor):
            stack.extend(obj.__dict__.values())
            if obj._base is not None:
                stack.append(obj._base)
            if obj.grad_fn is not None:
                stack.append(obj.grad_fn)
        stack.extend(gc.get_referents(obj))
    return offenders


def test_nothing_of_the_record_reachable_after_materialization():
    for ctor in (ViewsAndRandom, small_transformer):
        m = deferred_init(ctor)
        ref = weakref.ref(_record_of(m))
        assert _reachable_offenders(m)  # the traversal does find them before
        materialize_module(m)
        assert _reachable_offenders(m) == []
        for t in list(m.parameters()) + list(m.buffers()):
            assert not {"_record", "_value", "_storage", "_shadow"} & t.__dict__.keys()
        gc.collect()
        assert ref() is None, f"the record of a materialized {ctor.__name__} is still alive"


def test_nothing_reachable_after_tensor_by_tensor_materialization():
    m = deferred_init(ViewsAndRandom)
    ref = weakref.ref(_record_of(m))
    for t in reversed(list(m.buffers()) + list(m.parameters())):
        materialize_tensor(t)
    assert _reachable_offenders(m) == []
    gc.collect()
    assert ref() is None


# -- memory stays flat over hundreds of iterations ---------------------------


def _cycle(ctor):
    m = deferred_init(ctor)
    materialize_module(m)
    return m


def _flat(ctor, iterations, warmup, bytes_per_iteration):
    """Live objects and traced bytes hold flat over ``iterations`` cycles.

    Live objects (what ``gc`` tracks: tensors, modules, nodes, records...)
    may not grow by even one per iteration.  Traced bytes get a coarser
    bound: PyTorch and CPython keep small caches that fill up over the
    first few hundred calls (a few hundred bytes per iteration, decaying),
    while leaking the record of one deferral costs kilobytes (one node and
    value alone are over 300 bytes).
    """
    for _ in range(warmup):
        _cycle(ctor)
    gc.collect()
    tracemalloc.start()
    try:
        gc.collect()
        before_bytes = tracemalloc.get_traced_memory()[0]
        before_objects = len(gc.get_objects())
        for _ in range(iterations):
            _cycle(ctor)
        gc.collect()
        grown_bytes = tracemalloc.get_traced_memory()[0] - before_bytes
        grown_objects = len(gc.get_objects()) - before_objects
        snapshot = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    top = "\n".join(str(s) for s in snapshot.statistics("lineno")[:8])
    assert grown_objects < iterations // 4, f"{grown_objects} more live objects after {iterations} iterations"
    assert grown_bytes < bytes_per_iteration * iterations, (
        f"{grown_bytes} more traced bytes after {iterations} iterations:\n{top}")


def test_repeated_deferral_and_materialization_is_flat():
    _flat(ViewsAndRandom, iterations=300, warmup=100, bytes_per_iteration=1024)


def test_repeated_transformer_is_flat():
    _flat(small_transformer, iterations=100, warmup=30, bytes_per_iteration=4096)


def test_a_leaked_record_would_be_noticed():
    """Keeping each deferred module's record alive breaks the bounds (the bytes
    bound on its own, not only the object count)."""
    kept = []

    def leaky():
        m = ViewsAndRandom()
        fake = deferred_init(ViewsAndRandom)
        kept.append(_record_of(fake))
        return m

    try:
        _flat(leaky, iterations=100, warmup=5, bytes_per_iteration=1024)
    except AssertionError as e:
        assert "bytes" in str(e) or "objects" in str(e)
    else:
        raise AssertionError("a leaked record per iteration went unnoticed")


def test_leak_check_can_fail():
    """The bounds catch a leak of one small container per iteration."""
    kept = []

    def leaky():
        m = ViewsAndRandom()
        kept.append([])
        return m

    try:
        _flat(leaky, iterations=300, warmup=10, bytes_per_iteration=1024)
    except AssertionError:
        pass
    else:
        raise AssertionError("a leak of one object per iteration went unnoticed")


def test_a_loaded_deferred_module_frees_its_record_and_checkpoint_without_gc(tmp_path):
    """Load nodes hold their checkpoint entries, and entries their file: no
    cycle, so dropping the module frees the record and the file's header."""
    from safetensors.torch import save_file

    from deferinit.materialize import load_checkpoint
    from deferinit.materialize.checkpoint.files import Source

    save_file(nn.Linear(8, 8).state_dict(), tmp_path / "m.safetensors")
    m = deferred_init(nn.Linear, 8, 8)
    load_checkpoint(m, tmp_path / "m.safetensors")
    node = m.weight._storage.head
    assert node.kind == "load"
    file = weakref.ref(node.payload.source)
    assert isinstance(file(), Source)  # the one checkpoint-source base (files and DCP)
    ref = weakref.ref(_record_of(m))
    del node
    gc.disable()
    try:
        del m
        assert ref() is None and file() is None, "the record or the checkpoint outlived the module"
    finally:
        gc.enable()
