"""Runs every benchmark and writes docs/benchmarks.md from their output.

``python benchmarks/run_all.py`` (or ``make bench``).  Each benchmark is a
script with a ``main() -> str`` that prints a markdown table when run alone;
the figures in the docs are exactly what they print.

``python benchmarks/run_all.py defer_70b materialize_speed`` reruns only the
named scripts and keeps the other sections as they were; every section says
the day it was produced.
"""

from __future__ import annotations

import datetime
import importlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
DOCS = os.path.join(os.path.dirname(HERE), "docs", "benchmarks.md")

# (title, script module, what it shows)
BENCHMARKS = [
    ("Deferring a 70B model", "defer_70b", "Construction time and memory of a Llama-3-70B-shaped model: meta device, deferred_init, FakeTensorMode."),
    ("Materializing against eager construction", "materialize_speed", "Time and peak RSS of deferred_init + materialize_module against eager construction, each in a fresh process."),
    ("A part costs its part", "parts", "One decoder layer of a deferred Llama-3-8B and of the 70B demo Llama, 50,000 small parameters, a DeepSeek-V3-shaped mixture of experts: materialization against eager construction of the piece, each in a fresh process."),
    ("Loading a checkpoint", "checkpoint", "A safetensors checkpoint into the 185M GPT and a transformers Llama: eager, meta + to_empty, accelerate, deferred_init + load_checkpoint (and from_pretrained); then 2 FSDP2 ranks, each reading its own rows; then the GPT as a distributed checkpoint (dcp.save on 2 ranks), loaded the torchtitan way (meta + to_empty + init + dcp.load) and with load_checkpoint, on 1 and 2 ranks."),
    ("Sharding on paper", "sharding", "A 70B model sharded over 8 and 64 ranks, deferred: per-rank bytes, largest transient, time to materialize one rank's shards of a smaller model."),
    ("Quantizing before materializing", "quantized", "An 8-layer Llama-shaped model (hidden 4096, 1.88e9 parameters) quantized int8 weight-only with torchao's quantize_: eager construct-then-quantize against quantize_ on the deferred model then materialize_module, each in a fresh process: peak RSS against the bound (quantized model + 1.2 x its largest full-precision tensor), and a digest of every inner tensor compared."),
    ("Drawing a record", "render_graph", "to_dot on the 70B record and rendering to SVG."),
    ("Planning a training step", "planning", "One training step of the 70B Llama (bf16, batch 1x4096) on fake devices under PyTorch's FSDPMemTracker and FlopCounterMode, sharded over 8 fake ranks: deferinit against PyTorch's FakeTensorMode where it can run; and the recipe of docs/planning.md (fp32 master weights, bf16 FSDP2 compute, activation checkpointing)."),
    ("accelerate's dispatch_model on a deferred model", "dispatch", "dispatch_model (every module hooked on the CPU) of a deferred model, whose tensors become real one by one as accelerate asks for their data_ptr(), against materialize_module first and against eager construction."),
    ("Two threads materializing", "threads", "Two unrelated models materialized one after the other, from two threads (the lock of deferinit/exclusive.py makes them take turns), from two threads without the lock, and one model from two threads at once."),
    ("What the patches cost code that is not deferred", "patch_overhead", "Nanoseconds per call of .data, .data =, set_, nn.Parameter and random calls, each column in a fresh process: PyTorch alone, the packages imported, after a fake was made, while a deferral's draws are pending (random calls with a generator of their own), after that deferral warned."),
]


def kept_sections(path: str) -> dict:
    """The sections of the page at ``path`` by heading line (without their heading)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return {}
    found = {}
    for block in ("\n" + text).split("\n## ")[1:]:
        heading, _, body = block.partition("\n")
        found["## " + heading] = body.strip("\n")
    return found


def main(only=()) -> None:
    unknown = set(only) - {name for _, name, _ in BENCHMARKS}
    if unknown:
        raise SystemExit(f"no benchmark named {', '.join(sorted(unknown))}; the names: {', '.join(n for _, n, _ in BENCHMARKS)}")
    kept = kept_sections(DOCS)
    today = datetime.date.today().isoformat()
    parts = [
        "# Benchmarks",
        "",
        "Produced by `python benchmarks/run_all.py` (all of them, or the scripts named on its command line); "
        "every table below is the output of the script named in its heading, on the day its section gives. "
        "These machines are shared and noisy: figures vary by several percent from run to run.",
        "",
    ]
    for title, name, what in BENCHMARKS:
        path = os.path.join(HERE, f"{name}.py")
        if not os.path.exists(path):
            continue
        heading = f"## {title} (`benchmarks/{name}.py`)"
        if only and name not in only:
            if heading in kept:
                parts += [heading, "", kept[heading], ""]
            continue
        print(f"running {name} ...", flush=True)
        module = importlib.import_module(name)
        output = module.main()
        print(output, flush=True)
        parts += [heading, "", what, "", f"Run on {today}.", "", output, ""]
    # The GPU section comes from make gpu-check on a machine with CUDA, not
    # from this run: keep the one already written.
    from gpu_replay import kept_section

    gpu = kept_section(DOCS)
    if gpu:
        parts += [gpu]
    with open(DOCS, "w") as f:
        f.write("\n".join(parts).rstrip() + "\n")
    print(f"wrote {DOCS}")


if __name__ == "__main__":
    main(sys.argv[1:])
