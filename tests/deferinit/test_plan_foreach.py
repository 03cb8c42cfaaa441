"""Foreach operators over DTensors run in chunks while a step is planned
(deferinit.cli.foreach): the same tensors, values and figures as PyTorch's
own unchunked call."""

from __future__ import annotations

import pytest
import torch

from deferinit import deferred_init
from deferinit.cli import foreach
from deferinit.cli.fakedist import fake_ranks
from deferinit.cli.foreach import ChunkedForeach
from deferinit.cli.plan import shard
from fake import fake_mode

from deferinit.cli.step import measure_step

from .test_plan import inputs, llama, per_module, step


def _dtensors(mesh, n, seed):
    from torch.distributed.tensor import DTensor, Shard

    # The fake process group moves no data: build each rank's piece here.
    g = torch.Generator().manual_seed(seed)
    shapes = [(2, 4), (1,), (0, 3), (4, 2)]  # shapes that repeat and differ, one piece empty
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
