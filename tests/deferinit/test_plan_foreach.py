"""Foreach operators over DTensors run in chunks while a step is planned
(deferinit.planning.foreach): the same tensors, values and figures as PyTorch's
own unchunked call."""

from __future__ import annotations

import random

import pytest
import torch

from deferinit import deferred_init
from deferinit.planning import foreach
from deferinit.planning.process_group import fake_ranks
from deferinit.planning.foreach import ChunkedForeach, bounds
from deferinit.planning.recipe import shard
from deferinit.fake import fake_mode

from deferinit.planning.step import measure_step

from .test_plan import inputs, llama, per_module, step


def _dtensors(mesh, n, seed, shapes=((2, 4), (1,), (0, 3), (4, 2))):  # repeating and differing, one empty
    from torch.distributed.tensor import DTensor, Shard

    # The fake process group moves no data: build each rank's piece here.
    g = torch.Generator().manual_seed(seed)
    return [DTensor.from_local(torch.rand(shapes[i % 4], generator=g) + 0.5, mesh, [Shard(0)], run_check=False)
            for i in range(n)]


def _locals(ts):
    return [t.to_local().clone() for t in ts]


CALLS = {
    "add_ list": lambda a, b, c: torch._foreach_add_(a, b),
    "addcdiv_ scalar list": lambda a, b, c: torch._foreach_addcdiv_(a, b, c, [0.1 * i for i in range(len(a))]),
    "addcmul_ scalar": lambda a, b, c: torch._foreach_addcmul_(a, b, c, value=0.3),
    "lerp_": lambda a, b, c: torch._foreach_lerp_(a, b, 0.25),
    "mul out of place": lambda a, b, c: torch._foreach_mul(a, 3.0),
    "sqrt out of place": lambda a, b, c: torch._foreach_sqrt(a),
    "div_ list": lambda a, b, c: torch._foreach_div_(a, b),
    "maximum_ list": lambda a, b, c: torch._foreach_maximum_(a, c),
    "norm": lambda a, b, c: torch._foreach_norm(a),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_chunked_foreach_call_gives_pytorchs_tensors(call):
    with fake_ranks(4, 1, "cpu") as mesh:
        results = []
        for chunked in (False, True):
            a, b, c = (_dtensors(mesh, 11, seed) for seed in (1, 2, 3))
            if chunked:
                with ChunkedForeach(chunk=3):
                    out = CALLS[call](a, b, c)
            else:
                out = CALLS[call](a, b, c)
            results.append((type(out), _locals(a), _locals(out) if out is not None else None,
                            [(o.placements, o.shape) for o in out] if out is not None else None))
    (want_type, want_a, want_out, want_specs), (got_type, got_a, got_out, got_specs) = results
    assert got_type is want_type
    assert all(torch.equal(x, y) for x, y in zip(got_a, want_a, strict=True))
    if want_out is not None:
        assert got_specs == want_specs
        assert all(torch.equal(x, y) for x, y in zip(got_out, want_out, strict=True))


def test_calls_that_are_not_foreach_over_dtensors_are_not_cut(monkeypatch):
    seen = []
    real = torch._foreach_add_

    class Counting(ChunkedForeach):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return super().__torch_function__(func, types, args, kwargs)

    plain = [torch.ones(2) for _ in range(10)]
    with Counting(chunk=2):
        torch._foreach_add_(plain, 1.0)  # plain tensors: one call
        torch.add(plain[0], 1.0)
    assert seen.count(real) == 1 and all(torch.equal(t, torch.full((2,), 2.0)) for t in plain)
    with pytest.raises(ValueError, match="chunk must be at least 1"):
        ChunkedForeach(chunk=0)


def _sharded_step(planned, rank, chunk, monkeypatch, fused=False):
    monkeypatch.setattr(foreach, "CHUNK", chunk)
    torch.manual_seed(0)
    with fake_ranks(4, rank, "cpu") as mesh:
        model = deferred_init(llama) if planned else llama()
        with fake_mode() if planned else _nothing():
            shard(model, mesh)
            if fused:
                args, kwargs, ids = inputs("llama")
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
                measured = measure_step(model, args, kwargs, opt, token_ids=ids, sharded=True)
            else:
                measured = step("llama", model, foreach=True, sharded=True)
            values = None if planned else [p.to_local().clone() for p in model.parameters()]
    stats = {s.mod_fqn: (s.local_peak, s.snapshots) for s in measured.tracker.memory_tracking.values()}
    return measured, per_module(model, measured), stats, values


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("planned", [False, True], ids=["real", "planned"])
def test_a_sharded_adamw_step_measures_and_updates_as_unchunked(planned, fused, monkeypatch):
    """FSDP2 over 4 fake ranks, AdamW foreach (or fused) over the llama's parameters
    (more than 2): chunks of 2 against one call (PyTorch's own): the same peak, what
    stays after, per-module figures, FLOPs and, on real tensors, the same parameters
    after the step."""
    n_params = len(list(llama().parameters()))
    assert n_params > 2
    want = _sharded_step(planned, 0, 10**9, monkeypatch, fused)
    got = _sharded_step(planned, 0, 2, monkeypatch, fused)
    assert got[0].peak == want[0].peak
    assert got[0].after == want[0].after
    assert got[0].flops == want[0].flops > 0
    assert got[1] == want[1] and got[2] == want[2]
    if not planned:
        assert all(torch.equal(x, y) for x, y in zip(got[3], want[3], strict=True))


def _kind_lists():
    rng = random.Random(0)
    lists = [[], [0], [7] * 40, list(range(40)), _LLAMA_KINDS]
    for _ in range(300):
        unit = [rng.randrange(5) for _ in range(rng.randint(1, 20))]
        head = [rng.randrange(9) for _ in range(rng.randint(0, 5))]
        tail = [rng.randrange(9) for _ in range(rng.randint(0, 5))]
        lists.append(head + unit * rng.randint(0, 6) + tail)
    return lists


# The parameters of a Llama in order: embedding, 80 layers of (attention norm,
# q, k, v, o, MLP norm, gate, up, down), final norm, head; equal kinds, equal specs.
_LLAMA_KINDS = [0] + [1, 2, 3, 3, 4, 1, 5, 6, 7] * 80 + [1, 8]


@pytest.mark.parametrize("chunk", [1, 2, 3, 16])
def test_bounds_cut_every_list_into_consecutive_chunks_of_at_most_chunk(chunk):
    for kinds in _kind_lists():
        cuts = bounds(kinds, chunk)
        assert [lo for lo, _ in cuts] == ([0] if cuts else []) + [hi for _, hi in cuts[:-1]]
        assert (cuts[-1][1] if cuts else 0) == len(kinds)
        assert all(1 <= hi - lo <= chunk for lo, hi in cuts)


def _distinct(kinds, cuts):
    return {tuple(kinds[lo:hi]) for lo, hi in cuts}


def test_bounds_follow_a_lists_period():
    cuts = bounds(_LLAMA_KINDS, 16)
    assert _distinct(_LLAMA_KINDS, cuts) == {(0,), (1, 2, 3, 3, 4, 1, 5, 6, 7), (1, 8)}
    assert len(_distinct(_LLAMA_KINDS, [(lo, min(lo + 16, 723)) for lo in range(0, 723, 16)])) == 11
    # a period longer than a chunk: each period is cut the same way
    kinds = [9] + list(range(20)) * 6 + [9]
    assert _distinct(kinds, bounds(kinds, 8)) == {(9,), tuple(range(8)), tuple(range(8, 16)), tuple(range(16, 20))}
    # a list without one: every chunk elements
    assert bounds(list(range(10)), 4) == [(0, 4), (4, 8), (8, 10)]


def test_a_periodic_dtensor_list_is_propagated_once_per_distinct_chunk(monkeypatch):
    """DTensor caches a propagation by the specs of the chunk: chunks on the list's
    period (4 shapes repeating) need one; with chunks of 3 each period is cut
    into 3 + 1, two (cuts every 3 elements would need four)."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    seen = []
    real = ShardingPropagator.propagate_op_sharding_non_cached

    def counting(self, schema):
        if schema.op is torch.ops.aten._foreach_mul.Scalar:
            seen.append(schema)
        return real(self, schema)

    monkeypatch.setattr(ShardingPropagator, "propagate_op_sharding_non_cached", counting)
    with fake_ranks(4, 1, "cpu") as mesh:
        # shapes no other test uses: DTensor's cache is keyed by the tensors' specs
        a = _dtensors(mesh, 24, seed=4, shapes=((3, 5), (2,), (5, 1), (1, 7)))
        with ChunkedForeach(chunk=4):
            out = torch._foreach_mul(a, 1.0625)
        assert len(seen) == 1
        assert all(torch.equal(o.to_local(), x.to_local() * 1.0625) for o, x in zip(out, a, strict=True))
        with ChunkedForeach(chunk=3):
            torch._foreach_mul(a, 1.125)
        assert len(seen) == 1 + 2


@pytest.mark.parametrize("other", ["replicate", "shard(1)", "partial"])
def test_a_call_whose_lists_are_laid_out_differently_peaks_as_unchunked(other):
    """``_foreach_add_(a, b)`` with ``a`` sharded on dim 0 and ``b`` laid out
    otherwise: DTensor redistributes every element of ``b`` before the local
    operator runs. PyTorch's unchunked call holds all of them at once; chunks
    would hold a chunk's worth, and MemTracker's peak would be lower."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    placement, shape = {"replicate": (Replicate(), (32, 4)), "shard(1)": (Shard(1), (32, 1)),
                        "partial": (Partial(), (32, 4))}[other]
    results = []
    for chunked in (False, True):
        with fake_ranks(4, 1, "cpu") as mesh:
            g = torch.Generator().manual_seed(0)
            a = [DTensor.from_local(torch.rand(8, 4, generator=g), mesh, [Shard(0)], run_check=False) for _ in range(10)]
            b = [DTensor.from_local(torch.rand(shape, generator=g), mesh, [placement], run_check=False) for _ in range(10)]
            tracker = MemTracker()
            with tracker, ChunkedForeach(chunk=3) if chunked else _nothing():
                torch._foreach_add_(a, b)
            results.append((tracker.get_tracker_snapshot("peak"), _locals(a)))
    (want_peak, want_a), (got_peak, got_a) = results
    assert got_peak == want_peak
    assert all(torch.equal(x, y) for x, y in zip(got_a, want_a, strict=True))
