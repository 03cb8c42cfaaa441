"""Sharding on paper and for real: a 70B model over 8 and 64 ranks, deferred.

1. **On paper.**  A Llama-3-70B-shaped model (bf16), deferred, FSDP2-sharded
   (``fully_shard`` per decoder layer and the root) over 8 and 64 ranks.  One
   process plays one rank through PyTorch's fake process group (no other
   process, no communication, nothing allocated).  For that rank:
   the bytes it keeps after materialization, the largest transient (the
   full parameter a replay computes before cutting this rank's slice) and
   their sum, the rank's peak, all read from the record by
   ``deferinit.materialize.distributed.sharded_memory_cost``; and the time to record
   the model, to shard it and to estimate.
2. **For real.**  A 1.1B-parameter Llama (bf16) sharded over 8 ranks: rank
   0's shards are materialized (and checked against eager slices), next to
   eager construction of the whole model: time and measured peak resident
   memory (``/proc/self/clear_refs``, with ``MALLOC_MMAP_THRESHOLD_`` set so
   that freed tensors leave the process at once).

Each figure comes from a fresh process.  Run: ``python benchmarks/sharding.py``
(prints markdown; ``--quick`` for tiny shapes).  Child mode (internal):
``python benchmarks/sharding.py child paper|real WORLD RANK [--quick]``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import machine, run_child, table  # noqa: E402

GiB = 2**30
MiB = 2**20


def configs(quick: bool):
    from transformers import LlamaConfig

    big = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
               num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192)
    small = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048)
    if quick:
        tiny = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)
        big, small = tiny, dict(tiny, num_hidden_layers=2)
    return LlamaConfig(**big), LlamaConfig(**small)


class fake_rank:
    """Play rank ``rank`` of ``world_size`` in this process (PyTorch's fake process group)."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def __enter__(self):
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=self.rank, world_size=self.world_size)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        dist.destroy_process_group()


def build(config, deferred: bool):
    import torch
    import transformers

    from deferinit import deferred_init

    transformers.logging.set_verbosity_error()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        torch.manual_seed(0)
        cls = transformers.LlamaForCausalLM
        return deferred_init(cls, config) if deferred else cls(config)
    finally:
        torch.set_default_dtype(previous)


def shard(model) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return -1


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM, the peak resident size
        return True
    except OSError:
        return False


def child_paper(world: int, rank: int, quick: bool) -> dict:
    from deferinit.materialize.distributed import sharded_memory_cost

    big, _ = configs(quick)
    with fake_rank(rank, world):
        start = time.perf_counter()
        model = build(big, deferred=True)
        record_s = time.perf_counter() - start
        full = sum(p.numel() * p.element_size() for p in model.parameters())
        numel = sum(p.numel() for p in model.parameters())
        start = time.perf_counter()
        shard(model)
        shard_s = time.perf_counter() - start
        start = time.perf_counter()
        plan = sharded_memory_cost(model)
        plan_s = time.perf_counter() - start
        kept = sum(g.kept_bytes for g in plan)
        largest = max(plan, key=lambda g: g.transient_bytes)
        return {
            "params": numel, "full": full, "kept": kept, "transient": largest.transient_bytes,
            "transient_of": largest.names[0], "replays": len(plan),
            "record_s": record_s, "shard_s": shard_s, "plan_s": plan_s,
        }


def child_real(world: int, rank: int, quick: bool) -> dict:
    import torch

    from deferinit.materialize import materialize_module
    from deferinit.materialize.distributed import sharded_memory_cost

    _, small = configs(quick)
    measured = reset_peak()
    before = status("VmRSS")
    start = time.perf_counter()
    eager = build(small, deferred=False)
    eager_s = time.perf_counter() - start
    eager_peak = status("VmHWM") - before
    full = sum(p.numel() * p.element_size() for p in eager.parameters())
    numel = sum(p.numel() for p in eager.parameters())
    expected = {name: torch.chunk(p.detach(), world)[rank].clone() for name, p in eager.named_parameters()}
    del eager
    gc.collect()

    with fake_rank(rank, world):
        start = time.perf_counter()
        model = build(small, deferred=True)
        shard(model)
        prepare_s = time.perf_counter() - start
        plan = sharded_memory_cost(model)
        planned = sum(g.kept_bytes for g in plan) + max(g.transient_bytes for g in plan)
        expected_bytes = sum(t.numel() * t.element_size() for t in expected.values())
        gc.collect()
        reset_peak()
        before = status("VmRSS")
        start = time.perf_counter()
        materialize_module(model)
        materialize_s = time.perf_counter() - start
        peak = status("VmHWM") - before
        kept = sum(p._local_tensor.untyped_storage().nbytes() for p in model.parameters())
        exact = all(torch.equal(p._local_tensor, expected[name]) for name, p in model.named_parameters())
    return {
        "params": numel, "full": full, "eager_s": eager_s, "eager_peak": eager_peak if measured else -1,
        "prepare_s": prepare_s, "materialize_s": materialize_s, "peak": peak if measured else -1,
        "kept": kept, "planned": planned, "exact": exact, "expected_bytes": expected_bytes,
    }


def child(argv) -> None:
    import torch

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    kind, world, rank = argv[0], int(argv[1]), int(argv[2])
    quick = "--quick" in argv
    result = child_paper(world, rank, quick) if kind == "paper" else child_real(world, rank, quick)
    print(json.dumps(result))


def main(quick: bool = False) -> str:
    script = os.path.abspath(__file__)
    flags = ["--quick"] if quick else []
    before = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by the children at start
    try:
        paper = [(w, r, run_child(script, "child", "paper", str(w), str(r), *flags)) for w in (8, 64) for r in (0, w - 1)]
        real = run_child(script, "child", "real", "8", "0", *flags)
    finally:
        if before is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = before

    gib = lambda b: f"{b / GiB:,.2f} GiB"
    mib = lambda b: f"{b / MiB:,.0f} MiB" if b >= 0 else "n/a"
    first = paper[0][2]
    rows = [
        [w, r, gib(p["kept"]), f"{gib(p['transient'])} (`{p['transient_of'].split(' ')[0]}`)",
         gib(p["kept"] + p["transient"]), f"{(p['kept'] + p['transient']) / p['full']:.3f}", p["replays"],
         f"{p['record_s']:.2f} s", f"{p['shard_s']:.2f} s", f"{p['plan_s']:.2f} s"]
        for w, r, p in paper
    ]
    real_rows = [
        ["eager construction, whole model", f"{real['eager_s']:.2f} s", mib(real["eager_peak"]), mib(real["full"])],
        ["`deferred_init` + `fully_shard`", f"{real['prepare_s']:.2f} s", "–", "0 MiB"],
        ["`materialize_module`, rank 0's shards", f"{real['materialize_s']:.2f} s", mib(real["peak"]), mib(real["kept"])],
        ["estimated by `sharded_memory_cost`", "", mib(real["planned"]), ""],
    ]
    ratio_t = real["materialize_s"] / real["eager_s"]
    ratio_m = real["peak"] / real["eager_peak"] if real["eager_peak"] > 0 and real["peak"] >= 0 else float("nan")
    return "\n".join([
        f"Machine: {machine()}",
        "",
        f"{first['params'] / 1e9:.1f}B-parameter Llama ({gib(first['full'])} in bf16), FSDP2 `fully_shard` per "
        "decoder layer and root, one rank played through the fake process group; nothing is allocated:",
        "",
        table(["ranks", "rank", "rank keeps", "largest transient (tensor)", "rank's peak", "peak / model",
               "replays", "record", "fully_shard", "estimate"], rows),
        "",
        f"{real['params'] / 1e9:.2f}B-parameter Llama (bf16), rank 0 of 8, materialized for real "
        f"(shards equal eager's slices: {'yes' if real['exact'] else 'NO'}):",
        "",
        table(["", "time", "peak resident memory added", "kept"], real_rows),
        "",
        f"Materializing one rank's shards takes {ratio_t:.2f}x the time of eager construction of the whole model "
        f"(the rank draws its rows' random numbers; the generator jumps over the rest; goal 0.3x) "
        f"and {ratio_m:.2f}x its peak memory.",
    ])


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(sys.argv[2:])
    else:
        print(main(quick="--quick" in sys.argv))
