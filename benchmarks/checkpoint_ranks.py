"""The GPT checkpoint loaded by 2 FSDP2 ranks (part of ``benchmarks/checkpoint.py``).

Two gloo ranks on this machine, each a fresh process, each sharding the
GPT with ``fully_shard`` (per block, then the root):

* ``deferinit``: ``deferred_init``, ``fully_shard``, ``load_checkpoint``,
  ``materialize_module`` (and the load recorded before ``fully_shard``);
* ``eager``: eager construction, ``load_state_dict(load_file(path))``, ``fully_shard``.

Per rank: the bytes it read (``rchar``: what it asked the file for;
``read_bytes``: what the disk delivered, the file dropped from the page
cache first), its peak RSS above what it held after imports, whether its
shards equal the checkpoint's rows, and how many random kernels ran
(``torch.profiler`` around the load).
"""

from __future__ import annotations

import datetime
import os
import socket
import time

from _common import table

MB = 1e6
ARMS = {
    "deferinit_after": "`deferred_init` + `fully_shard` + `load_checkpoint` + `materialize_module`",
    "deferinit_before": "`deferred_init` + `load_checkpoint` + `fully_shard` + `materialize_module`",
    "eager": "eager + `load_state_dict(load_file)` + `fully_shard`",
}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _io() -> dict:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


def _rank(rank, world, port, path, arm, quick, results):
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=600))
        results.put((rank, _load(rank, world, path, arm, quick)))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        import traceback

        results.put((rank, {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}))


def _load(rank, world, path, arm, quick):
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file
    from torch.distributed.fsdp import fully_shard
    from torch.profiler import ProfilerActivity, profile

    from checkpoint import quick_models
    from deferinit import deferred_init
    from deferinit.materialize import load_checkpoint, materialize_module
    from materialize_speed import gpt_185m

    build = quick_models()["gpt"][1] if quick else gpt_185m

    def shard(m):
        for block in m.blocks:
            fully_shard(block)
        fully_shard(m)

    torch.manual_seed(0)
    base = _status("VmRSS")
    io0 = _io()
    start = time.perf_counter()
    random = None
    if arm == "eager":
        m = build()
        m.load_state_dict(load_file(path), strict=False)
        shard(m)
    else:
        m = deferred_init(build)
        if arm == "deferinit_before":
            load_checkpoint(m, path)
        shard(m)
        if arm == "deferinit_after":
            load_checkpoint(m, path)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            materialize_module(m)
        random = sum(1 for e in prof.events() if any(k in e.name for k in ("uniform_", "normal_", "rand")))
    seconds = time.perf_counter() - start
    io1 = _io()
    peak = _status("VmHWM")
    same = True
    with safe_open(path, framework="pt") as f:
        for name, p in m.named_parameters():
            key = "wte.weight" if name == "head.weight" else name
            full = f.get_slice(key)
            rows = full.get_shape()[0]
            step = -(-rows // world)
            piece = full[rank * step : min(rows, (rank + 1) * step)]
            same &= torch.equal(p._local_tensor, piece)
    return {"seconds": seconds, "rchar": io1["rchar"] - io0["rchar"], "read_bytes": io1["read_bytes"] - io0["read_bytes"],
            "peak_added": peak - base, "same": bool(same), "random": random}


def run(path: str, arm: str, quick: bool, world: int = 2) -> list[dict]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold: what the disk delivers
    os.close(fd)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, path, arm, quick, results)) for r in range(world)]
    for p in procs:
        p.start()
    out = dict(results.get(timeout=1200) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    errors = [r["error"] for r in out.values() if "error" in r]
    if errors:
        raise RuntimeError(errors[0])
    return [out[r] for r in range(world)]


def fsdp_table(path: str, quick: bool = False) -> str:
    size = os.path.getsize(path)
    rows = []
    for arm, label in ARMS.items():
        for rank, r in enumerate(run(path, arm, quick)):
            rows.append([
                label, rank, f"{r['rchar'] / MB:,.0f} MB", f"{r['rchar'] / size:.2f}x", f"{r['read_bytes'] / MB:,.0f} MB",
                f"{r['peak_added'] / MB:,.0f} MB", f"{r['seconds']:.2f} s", "yes" if r["same"] else "NO",
                "–" if r["random"] is None else r["random"],
            ])
    return "\n".join([
        f"2 FSDP2 ranks (gloo, one CPU thread each) load the GPT checkpoint ({size / MB:,.0f} MB), dropped from the page cache first:",
        "",
        table(["way", "rank", "bytes asked (rchar)", "of the file", "read from disk", "peak RSS added", "time",
               "shards = checkpoint rows", "random kernels"], rows),
    ])
