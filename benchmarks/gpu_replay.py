"""Materialization on a GPU against eager construction on the same GPU.

The models of ``materialize_speed.py`` (a 185M GPT in ``torch.nn`` and a
``transformers`` Llama), each built eagerly under ``torch.device("cuda")`` and
deferred under the same context then materialized there, each in a fresh
process: time (the device synchronized) and peak GPU memory
(``torch.cuda.max_memory_allocated``), and whether the values agree.
Without CUDA it says so and measures nothing.

Run: ``python benchmarks/gpu_replay.py`` (``make gpu-check`` runs it and writes
its table into docs/benchmarks.md).
Child mode (used internally): ``python benchmarks/gpu_replay.py child MODEL MODE``.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import machine, mib, run_child, table  # noqa: E402
from materialize_speed import MODELS  # noqa: E402


HEADING = "## On a GPU (`benchmarks/gpu_replay.py`, `make gpu-check`)"
_SECTION = re.compile(re.escape(HEADING) + r".*?(?=\n## |\Z)", re.S)


def kept_section(path: str) -> str:
    """The GPU section of the benchmark page at ``path``, or ``""``."""
    try:
        with open(path) as f:
            found = _SECTION.search(f.read())
    except OSError:
        return ""
    return found.group(0).rstrip("\n") if found else ""


def write_section(path: str, markdown: str) -> None:
    """Replace (or append) the GPU section of the benchmark page at ``path``."""
    with open(path) as f:
        text = f.read()
    section = f"{HEADING}\n\n{markdown.strip()}"
    text = _SECTION.sub(lambda _: section, text) if _SECTION.search(text) else text.rstrip("\n") + "\n\n" + section
    with open(path, "w") as f:
        f.write(text.rstrip("\n") + "\n")


def child(model: str, mode: str) -> dict:
    import torch

    from deferinit import deferred_init
    from deferinit.materialize import materialize_module

    if model.startswith("llama"):
        import transformers  # noqa: F401  (import cost outside the timings)
    device = torch.device("cuda")
    torch.empty(1, device=device)  # CUDA context and allocator, outside the timings
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    record_s = 0.0
    start = time.perf_counter()
    with torch.device(device):
        if mode == "eager":
            m = MODELS[model]()
        else:
            m = deferred_init(MODELS[model])
            record_s = time.perf_counter() - start
            start = time.perf_counter()
            materialize_module(m)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "record_s": record_s,
        "peak": torch.cuda.max_memory_allocated(),
        "params": sum(p.numel() for p in m.parameters()),
        "checksum": float(sum(p.double().sum() for p in m.parameters())),
        "gpu": torch.cuda.get_device_name(),
    }


def main(repeat: int = 3) -> str:
    import torch

    if not torch.cuda.is_available():
        return f"Skipped: no CUDA device ({machine()})."
    script = os.path.abspath(__file__)
    rows, gpu = [], ""
    for model in MODELS:
        runs = {mode: [run_child(script, "child", model, mode) for _ in range(repeat)] for mode in ("eager", "deferred")}
        gpu = runs["eager"][0]["gpu"]
        best = {mode: min(r["seconds"] for r in rs) for mode, rs in runs.items()}
        record = min(r["record_s"] for r in runs["deferred"])
        peak = {mode: min(r["peak"] for r in rs) for mode, rs in runs.items()}
        same = runs["eager"][0]["checksum"] == runs["deferred"][0]["checksum"]
        rows.append([
            model,
            f"{runs['eager'][0]['params'] / 1e6:.0f} M",
            f"{best['eager'] * 1e3:.0f} ms",
            f"{best['deferred'] * 1e3:.0f} ms",
            f"{best['deferred'] / best['eager']:.2f}x",
            f"{(best['deferred'] + record) / best['eager']:.2f}x",
            mib(peak["eager"]),
            mib(peak["deferred"]),
            f"{peak['deferred'] / peak['eager']:.2f}x",
            "yes" if same else "NO",
        ])
    return "\n".join([
        f"Machine: {machine()}, GPU {gpu}",
        "",
        table(["model", "params", "eager on cuda", "materialize on cuda", "time ratio", "ratio incl. deferral",
               "eager peak", "materialize peak", "peak ratio", "same values"], rows),
        "",
        f"Best of {repeat} fresh processes per cell; float32; peak is torch.cuda.max_memory_allocated.",
    ])


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        print(json.dumps(child(sys.argv[2], sys.argv[3])))
    else:
        print(main())
