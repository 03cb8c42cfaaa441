"""Loading a safetensors checkpoint into a model: time, peak memory, bytes read.

Two models (those of ``materialize_speed.py``): the ~185M-parameter GPT in
plain ``torch.nn`` (head tied to the embedding, saved once, as transformers
does) and a transformers Llama of similar size, each saved to one
``.safetensors`` file.  Ways to get the model with the checkpoint's weights:

* ``eager``: construction, then ``load_state_dict(load_file(path))``;
* ``meta``: construction on the meta device, ``to_empty("cpu")`` (re-tie),
  ``load_state_dict(load_file(path))``;
* ``accelerate``: ``init_empty_weights()`` construction (re-tie), then
  ``load_checkpoint_and_dispatch(model, path, device_map={"": "cpu"})``:
  the weights stay views of the file's memory map, read when first used;
* ``deferinit``: ``deferred_init`` + ``load_checkpoint`` + ``materialize_module``;
* for the Llama also ``from_pretrained`` (transformers' own loader) and
  ``deferred_init(LlamaForCausalLM.from_pretrained, folder)`` + materialize.

Each figure comes from its own fresh process (peak RSS is per process: the
``VmHWM`` of ``/proc/self/status``, which, unlike ``ru_maxrss``, does not
inherit the parent's).  *load* is the time until the call returns, *+ use*
adds a first pass over every weight (a sum), which is when accelerate and
``from_pretrained`` read theirs (their weights are views of the file's
memory map, so their pages then count in the process's RSS).  Warm: the file is in the page cache; cold: it was dropped
from it first (``posix_fadvise(DONTNEED)``), and *read from disk* is the
``read_bytes`` of ``/proc/self/io`` over load and use (memory-mapped reads
included).  Medians of ``--repeat`` runs.  Then a 2-rank FSDP2 run of the GPT
(``benchmarks/checkpoint_ranks.py``): bytes each rank reads and its peak; and
the GPT as a distributed checkpoint (``dcp.save`` by 2 FSDP2 ranks), loaded
the torchtitan way (meta + ``to_empty`` + init + ``dcp.load``) and with
``load_checkpoint``, by 1 process and by 2 ranks (``benchmarks/checkpoint_dcp.py``);
and a distributed checkpoint of 8,000 small chunks, ``dcp.load`` against
``load_checkpoint`` (``benchmarks/checkpoint_chunks.py``).

Run: ``python benchmarks/checkpoint.py [--repeat 3] [--quick]`` (prints
markdown).  Child mode (internal): ``... child MODEL ARM FOLDER``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import machine, run_child, table  # noqa: E402
from materialize_speed import gpt_185m, llama_small  # noqa: E402

MB = 1e6
ARMS = {
    "eager": "eager + `load_state_dict(load_file)`",
    "meta": "meta + `to_empty` + `load_state_dict(load_file)`",
    "accelerate": "accelerate `init_empty_weights` + `load_checkpoint_and_dispatch`",
    "deferinit": "`deferred_init` + `load_checkpoint` + `materialize_module`",
    "from_pretrained": "transformers `from_pretrained`",
    "deferred_from_pretrained": "`deferred_init(from_pretrained)` + `materialize_module`",
}
MODELS = {"gpt": ("gpt-185m (torch.nn)", gpt_185m), "llama": ("llama (transformers)", llama_small)}


def quick_models():
    import torch.nn as nn
    import transformers

    def gpt():
        class GPT(nn.Module):
            def __init__(self):
                super().__init__()
                self.wte = nn.Embedding(1000, 64)
                self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(2))
                self.head = nn.Linear(64, 1000, bias=False)
                self.head.weight = self.wte.weight

        return GPT()

    def llama():
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2))

    return {"gpt": ("gpt (tiny)", gpt), "llama": ("llama (tiny)", llama)}


def status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def io() -> dict:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


def retie(model) -> None:
    if hasattr(model, "wte") and hasattr(model, "head"):
        model.head.weight = model.wte.weight


def save(model_name: str, folder: str, quick: bool) -> None:
    """Write the checkpoint (a child process, so that the parent stays small)."""
    import torch
    from safetensors.torch import save_file

    build = (quick_models() if quick else MODELS)[model_name][1]
    torch.manual_seed(1234)
    m = build()
    if model_name == "llama":
        m.save_pretrained(folder)
    else:
        sd = {k: v for k, v in m.state_dict().items() if k != "head.weight"}
        save_file(sd, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def child(model_name: str, arm: str, folder: str, quick: bool) -> dict:
    import torch
    from safetensors.torch import load_file

    build = (quick_models() if quick else MODELS)[model_name][1]
    if model_name == "llama":
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.LlamaForCausalLM, transformers.LlamaConfig  # noqa: B018 (lazy imports, not timed)
    if os.environ.get("CHECKPOINT_BENCH_PREIMPORT") == "1":
        import torch._dynamo  # noqa: F401  (PyTorch imports it at the first random fill on meta)
    if arm == "accelerate":
        from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    from deferinit import deferred_init
    from deferinit.materialize import load_checkpoint, materialize_module

    path = os.path.join(folder, "model.safetensors")
    torch.manual_seed(0)
    base = status()["VmRSS"]
    io0 = io()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    if arm == "eager":
        m = build()
        m.load_state_dict(load_file(path), strict=False)
    elif arm == "meta":
        with torch.device("meta"):
            m = build()
        m.to_empty(device="cpu")
        retie(m)
        m.load_state_dict(load_file(path), strict=False)
    elif arm == "accelerate":
        with init_empty_weights():
            m = build()
        retie(m)
        m = load_checkpoint_and_dispatch(m, path, device_map={"": "cpu"})
    elif arm == "deferinit":
        m = deferred_init(build)
        load_checkpoint(m, path)
        materialize_module(m)
    elif arm == "from_pretrained":
        m = transformers.LlamaForCausalLM.from_pretrained(folder)
    elif arm == "deferred_from_pretrained":
        m = deferred_init(transformers.LlamaForCausalLM.from_pretrained, folder)
        materialize_module(m)
    else:
        raise ValueError(arm)
    seconds = time.perf_counter() - start
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    peak_load = status()["VmHWM"]
    start = time.perf_counter()
    with torch.no_grad():  # a first use of every weight, no copy of it
        checksum = sum(float(p.sum()) for p in m.parameters())
    use = time.perf_counter() - start
    io1 = io()
    return {
        "seconds": seconds, "use": use, "base": base, "peak": peak_load, "peak_used": status()["VmHWM"],
        "read_bytes": io1["read_bytes"] - io0["read_bytes"], "rchar": io1["rchar"] - io0["rchar"],
        "checksum": checksum, "tied": (m.head.weight is m.wte.weight) if hasattr(m, "wte") else None,
        "dynamo": "torch._dynamo" in sys.modules,
        "user": ru1.ru_utime - ru0.ru_utime, "sys": ru1.ru_stime - ru0.ru_stime,
        "minflt": ru1.ru_minflt - ru0.ru_minflt,
    }


def _cache(path: str, cold: bool) -> None:
    if cold:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    else:
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass


def _arms(model_name: str) -> list[str]:
    arms = ["eager", "meta", "accelerate", "deferinit"]
    try:
        import accelerate  # noqa: F401
    except ImportError:
        arms.remove("accelerate")
    if model_name == "llama":
        arms += ["from_pretrained", "deferred_from_pretrained"]
    return arms


def measure(model_name: str, folder: str, repeat: int, quick: bool, caches=(False, True), arms=None) -> dict:
    script = os.path.abspath(__file__)
    path = os.path.join(folder, "model.safetensors")
    flag = ["--quick"] if quick else []
    runs = {}
    for arm in arms or _arms(model_name):
        for cold in caches:
            cell = []
            for _ in range(repeat):
                _cache(path, cold)
                cell.append(run_child(script, "child", model_name, arm, folder, *flag))
            runs[(arm, cold)] = cell
    return runs


def _med(cell, key):
    return statistics.median(r[key] for r in cell)


def model_table(model_name: str, runs: dict, size: int, label: str) -> str:
    arms = [a for a in ARMS if (a, False) in runs]
    ref = {"seconds": _med(runs[("meta", False)], "seconds"), "peak": _med(runs[("meta", False)], "peak")}
    checksum = runs[("eager", False)][0]["checksum"]
    rows = []
    for arm in arms:
        warm, cold = runs[(arm, False)], runs[(arm, True)]
        same = all(abs(r["checksum"] - checksum) <= 1e-6 * max(1.0, abs(checksum)) for r in warm + cold)
        rows.append([
            ARMS[arm],
            f"{_med(warm, 'seconds'):.2f} s", f"{_med(warm, 'seconds') + _med(warm, 'use'):.2f} s",
            f"{_med(cold, 'seconds') + _med(cold, 'use'):.2f} s",
            f"{_med(warm, 'peak') / MB:,.0f} MB", f"{_med(warm, 'peak_used') / MB:,.0f} MB",
            f"{_med(cold, 'read_bytes') / MB:,.0f} MB",
            f"{_med(warm, 'seconds') / ref['seconds']:.2f}x", f"{_med(warm, 'peak') / ref['peak']:.2f}x",
            ("yes" if same else "NO") + ("" if warm[0]["tied"] in (None, True) else ", tie lost"),
        ])
    base = _med(runs[("deferinit", False)], "base")
    return "\n".join([
        f"**{label}**, checkpoint {size / MB:,.0f} MB; the process holds {base / MB:,.0f} MB after imports.",
        "",
        table(["way", "load (warm)", "load + use (warm)", "load + use (cold)", "peak RSS at load", "peak RSS after use",
               "read from disk (cold)", "load time / meta", "peak / meta", "same weights"], rows),
    ])


def preimported_table(folder: str, repeat: int, quick: bool) -> str:
    """The GPT again, warm, with ``torch._dynamo`` imported before the clock starts."""
    os.environ["CHECKPOINT_BENCH_PREIMPORT"] = "1"
    try:
        runs = measure("gpt", folder, repeat, quick, caches=(False,), arms=[a for a in _arms("gpt")])
    finally:
        del os.environ["CHECKPOINT_BENCH_PREIMPORT"]
    ref = runs[("meta", False)]
    rows = [
        [ARMS[arm], f"{_med(cell, 'seconds'):.2f} s", f"{_med(cell, 'peak') / MB:,.0f} MB",
         f"{_med(cell, 'seconds') / _med(ref, 'seconds'):.2f}x", f"{_med(cell, 'peak') / _med(ref, 'peak'):.2f}x"]
        for (arm, _), cell in runs.items()
    ]
    return "\n".join([
        "The same GPT arms (warm), `torch._dynamo` imported before the clock starts (not counted in any arm):",
        "",
        table(["way", "load", "peak RSS", "load time / meta", "peak / meta"], rows),
    ])


def main(repeat: int = 3, quick: bool = False) -> str:
    from checkpoint_chunks import chunks_table
    from checkpoint_dcp import dcp_table
    from checkpoint_ranks import fsdp_table

    parts = [f"Machine: {machine()}", ""]
    notes = [] if "accelerate" in _arms("gpt") else ["accelerate is not installed: its arm is left out."]
    dynamo = set()
    with tempfile.TemporaryDirectory() as root:
        for name, (label, _) in (quick_models() if quick else MODELS).items():
            folder = os.path.join(root, name)
            os.makedirs(folder)
            run_child(os.path.abspath(__file__), "save", name, folder, *(["--quick"] if quick else []))
            runs = measure(name, folder, repeat, quick)
            dynamo |= {f"{arm} ({name})" for (arm, _), cell in runs.items() if cell[0]["dynamo"]}
            path = os.path.join(folder, "model.safetensors")
            parts += [model_table(name, runs, os.path.getsize(path), label), ""]
            if name == "gpt":
                parts += [preimported_table(folder, repeat, quick), "", fsdp_table(path, quick), ""]
                parts += [dcp_table(os.path.join(root, "gpt-dcp"), quick, repeat), ""]
                parts += [chunks_table(root, 800 if quick else 8000, repeat), ""]
    parts += notes + [
        f"Medians of {repeat} fresh processes per cell (the FSDP2 table: one run); CPU, float32; MB = 10^6 bytes. "
        "Ratios are to the meta arm, warm. Goals (GPT): `load_checkpoint` time <= 0.3x and peak RSS <= 0.6x of "
        "meta + `to_empty` + `load_state_dict(load_file)`; load + use <= transformers `from_pretrained` (Llama); "
        "each FSDP2 rank of 2 reads <= 0.55x of the checkpoint; a DCP load <= 0.55x torchtitan's idiom on 1 and 2 "
        "ranks; 8,000 chunks in < 2x `dcp.load`'s time. "
        "Arms that import `torch._dynamo` on the way (PyTorch does at the first random fill on the meta device, "
        f"a few seconds once per process): {', '.join(sorted(dynamo)) or 'none'}. "
        "`to_empty` leaves buffers a constructor computes (the Llama's rotary `inv_freq`) uninitialised: the "
        "meta arm's Llama is not usable as it is.",
    ]
    return "\n".join(parts)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        print(json.dumps(child(sys.argv[2], sys.argv[3], sys.argv[4], "--quick" in sys.argv)))
    elif len(sys.argv) > 1 and sys.argv[1] == "save":
        save(sys.argv[2], sys.argv[3], "--quick" in sys.argv)
        print(json.dumps({}))
    else:
        parser = argparse.ArgumentParser()
        parser.add_argument("--repeat", type=int, default=3)
        parser.add_argument("--quick", action="store_true")
        args = parser.parse_args()
        print(main(args.repeat, args.quick))
