"""A distributed checkpoint of the GPT: torchtitan's idiom against ``load_checkpoint``
(part of ``benchmarks/checkpoint.py``).

The 185M GPT (``materialize_speed.gpt_185m``) is saved with ``dcp.save`` by
2 FSDP2 ranks (eager model, seed 1234), as a training job saves it.  It is
then loaded by 1 process (no sharding) and by 2 FSDP2 ranks (gloo, one CPU
thread each), each rank a fresh process, the checkpoint dropped from the
page cache first:

* ``titan``: torchtitan's idiom (``torchtitan/trainer.py``: construction on
  the meta device, ``fully_shard``, ``to_empty``, ``init_weights`` under
  ``no_grad``; then ``components/checkpointer/dcp.py``:
  ``dcp.load(state_dict)`` and ``ModelWrapper.load_state_dict``, i.e.
  ``model.load_state_dict(state_dict, strict=False)``); ``init_weights`` of
  a plain ``torch.nn`` model is every module's ``reset_parameters()``;
* ``deferinit_after``: ``deferred_init``, ``fully_shard``,
  ``load_checkpoint(model, folder)``, ``materialize_module``;
* ``deferinit_before``: the load recorded before ``fully_shard``.

Per rank: time, peak RSS above what the process held after imports, bytes
asked of files (``rchar``) and read from disk (``read_bytes``), random
kernels (``torch.profiler``), and a checksum of its local tensors (equal
across the arms: the same values).

Run alone: ``python benchmarks/checkpoint_dcp.py [--repeat 3] [--quick]``.
"""

from __future__ import annotations

import datetime
import os
import socket
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import table  # noqa: E402

MB = 1e6
ARMS = {
    "titan": "torchtitan: meta + `fully_shard` + `to_empty` + init + `dcp.load` + `load_state_dict`",
    "deferinit_after": "`deferred_init` + `fully_shard` + `load_checkpoint` + `materialize_module`",
    "deferinit_before": "`deferred_init` + `load_checkpoint` + `fully_shard` + `materialize_module`",
}
RANDOM = ("uniform_", "normal_", "rand", "bernoulli")


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _io() -> dict:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


def _build(quick: bool):
    from checkpoint import quick_models
    from materialize_speed import gpt_185m

    return quick_models()["gpt"][1] if quick else gpt_185m


def _shard(model, world: int) -> None:
    from torch.distributed.fsdp import fully_shard

    if world > 1:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)


def _save(rank, world, folder, quick):
    import torch
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(1234)
    model = _build(quick)()
    _shard(model, world)
    dcp.save(model.state_dict(), checkpoint_id=folder)
    return {}


def _load(rank, world, folder, arm, quick):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.profiler import ProfilerActivity, profile

    from deferinit import deferred_init
    from deferinit.materialize import load_checkpoint, materialize_module

    from torch.distributed.fsdp import fully_shard

    if world > 1:
        fully_shard(torch.nn.Linear(2, 2))  # its first call imports more of PyTorch: not counted
    build = _build(quick)
    with profile(activities=[ProfilerActivity.CPU]):
        pass  # the profiler's first start reads files of its own
    torch.manual_seed(0)
    torch.distributed.barrier()  # every rank starts the clock together
    base = _status("VmRSS")
    io0 = _io()
    start = time.perf_counter()
    if arm == "titan":
        # Random kernels counted from to_empty on: init_weights, then the load.
        with torch.device("meta"):
            model = build()
        _shard(model, world)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model.to_empty(device="cpu")
            if world == 1:
                model.head.weight = model.wte.weight  # re-tie, as the safetensors benchmark does
            with torch.no_grad():
                for m in model.modules():
                    if hasattr(m, "reset_parameters"):
                        m.reset_parameters()
            state = model.state_dict()
            dcp.load(state, checkpoint_id=folder)
            model.load_state_dict(state, strict=False)
    else:
        # Random kernels counted while materializing (recording runs eager's
        # argument checks on one-element stand-ins).
        model = deferred_init(build)
        if arm == "deferinit_before":
            load_checkpoint(model, folder)
        _shard(model, world)
        if arm == "deferinit_after":
            load_checkpoint(model, folder)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            materialize_module(model)
    seconds = time.perf_counter() - start
    io1 = _io()
    peak = _status("VmHWM")
    random = sum(1 for e in prof.events() if any(k in e.name for k in RANDOM))
    own = checksum = 0
    for t in list(model.parameters()) + list(model.buffers()):
        local = getattr(t, "_local_tensor", t).detach()
        own += local.numel() * local.element_size()
        checksum += float(local.sum(dtype=torch.float64))
    return {"seconds": seconds, "rchar": io1["rchar"] - io0["rchar"], "read_bytes": io1["read_bytes"] - io0["read_bytes"],
            "peak_added": peak - base, "random": random, "own": own, "checksum": checksum}


def _rank(rank, world, port, job, args, results):
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=900))
        results.put((rank, job(rank, world, *args)))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        import traceback

        results.put((rank, {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}))


def spawn(job, world: int, *args) -> list[dict]:
    """``job(rank, world, *args)`` on ``world`` fresh gloo processes; their results by rank."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, job, args, results)) for r in range(world)]
    for p in procs:
        p.start()
    out = dict(results.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    errors = [r["error"] for r in out.values() if "error" in r]
    if errors:
        raise RuntimeError(errors[0])
    return [out[r] for r in range(world)]


def _drop_cache(folder: str) -> None:
    for name in os.listdir(folder):
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _median_run(runs: list) -> list[dict]:
    """Per rank, the median of every figure over ``runs`` (lists of per-rank results)."""
    out = []
    for rank in range(len(runs[0])):
        cells = [run[rank] for run in runs]
        out.append({k: statistics.median(c[k] for c in cells) if k in _MEDIANS else cells[0][k] for k in cells[0]})
    return out


_MEDIANS = ("seconds", "rchar", "read_bytes", "peak_added")


def dcp_table(folder: str, quick: bool = False, repeat: int = 1) -> str:
    """Save the GPT with dcp.save on 2 FSDP2 ranks into ``folder``; load it every way
    (medians of ``repeat`` runs of each); a markdown table."""
    spawn(_save, 2, folder, quick)
    size = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))
    rows, ratios = [], []
    for world in (1, 2):
        runs = {arm: [] for arm in ARMS}
        for _ in range(repeat):
            for arm in ARMS:  # interleaved, so that a busy moment of the machine hits every arm
                _drop_cache(folder)
                runs[arm].append(spawn(_load, world, folder, arm, quick))
        runs = {arm: _median_run(cells) for arm, cells in runs.items()}
        for arm, label in ARMS.items():
            for rank, r in enumerate(runs[arm]):
                same = abs(r["checksum"] - runs["titan"][rank]["checksum"]) <= 1e-9 * max(1.0, abs(r["checksum"]))
                ref = runs["titan"][rank]
                rows.append([
                    label, f"{world}: {rank}", f"{r['seconds']:.2f} s", f"{r['peak_added'] / MB:,.0f} MB",
                    f"{r['rchar'] / MB:,.0f} MB", f"{r['rchar'] / size:.2f}x", f"{r['read_bytes'] / MB:,.0f} MB",
                    f"{r['seconds'] / ref['seconds']:.2f}x", f"{r['peak_added'] / max(ref['peak_added'], 1):.2f}x",
                    r["random"], "yes" if same else "NO",
                ])
                if arm != "titan":
                    ratios.append((world, arm, r["seconds"] / ref["seconds"], r["peak_added"] / max(ref["peak_added"], 1)))
    worst = {w: (max(t for x, _, t, _ in ratios if x == w), max(p for x, _, _, p in ratios if x == w)) for w in (1, 2)}
    return "\n".join([
        f"A distributed checkpoint of the GPT (`dcp.save` by 2 FSDP2 ranks: {size / MB:,.0f} MB in "
        f"{len(os.listdir(folder)) - 1} `.distcp` files; the tied head is saved under both names), loaded by 1 "
        "process (no sharding) and by 2 FSDP2 ranks (gloo, one CPU thread each), each a fresh process, the "
        f"checkpoint dropped from the page cache first; medians of {repeat} runs per arm:",
        "",
        table(["way", "ranks: rank", "time", "peak RSS added", "bytes asked (rchar)", "of the checkpoint",
               "read from disk", "time / torchtitan", "peak / torchtitan", "random kernels",
               "same as torchtitan"], rows),
        "",
        f"`load_checkpoint` against torchtitan's idiom, worst rank: {worst[1][0]:.2f}x the time and "
        f"{worst[1][1]:.2f}x the peak in 1 process, {worst[2][0]:.2f}x and {worst[2][1]:.2f}x on 2 FSDP2 ranks.",
    ])


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        repeat = int(sys.argv[sys.argv.index("--repeat") + 1]) if "--repeat" in sys.argv else 3
        print(dcp_table(os.path.join(root, "gpt-dcp"), "--quick" in sys.argv, repeat))
