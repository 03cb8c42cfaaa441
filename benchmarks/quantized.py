"""Quantizing before materializing: a Llama-shaped model, int8 weight-only, deferred.

An 8-decoder-layer Llama-shaped model in plain ``torch.nn`` (``deferinit.demo.Llama``,
hidden size 4096, MLP 11008, 32 heads, vocabulary 32000: Llama 2 7B's
layers; 1.88e9 parameters, float32) is quantized with torchao's
``quantize_(model, Int8WeightOnlyConfig())``, in two fresh processes:

* **eager**: ``Llama(shape)`` then ``quantize_``: the whole full-precision
  model exists before the first weight is quantized;
* **deferred**: ``with deferred(): Llama(shape)``, then ``quantize_`` on the
  deferred model, then ``materialize_module``: each weight is computed,
  quantized and freed before the next (``materialize/sharded.py``), and the
  quantization's pointwise steps run in place on the weight they consume
  (``materialize/reuse.py``).

Each prints its peak resident memory above the process's memory before the
model (``VmHWM`` reset through ``/proc/self/clear_refs``, with
``MALLOC_MMAP_THRESHOLD_`` set so that freed tensors leave the process at
once), the bytes the quantized model holds, and a digest of every tensor
(each wrapper's inner tensors and metadata): the two digests must agree.
The bound the deferred peak is held to: the quantized model plus 1.2x its
largest full-precision tensor.

Run: ``python benchmarks/quantized.py`` (about 7.5 GB for the eager process;
``--quick`` for a 2-layer hidden-1024 model).  Child mode (internal):
``python benchmarks/quantized.py child eager|deferred [--quick]``.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import machine, run_child, table  # noqa: E402

MiB = 2**20


def shape(quick: bool):
    from deferinit.demo import LlamaShape

    if quick:
        return LlamaShape(vocab_size=8000, hidden_size=1024, intermediate_size=2816, num_layers=2, num_heads=8, num_kv_heads=8)
    return LlamaShape(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=8, num_heads=32, num_kv_heads=32)


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


def leaves(t):
    """``(metadata, plain tensor)`` pairs of ``t``, walking wrapper subclasses."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(t):
        return [(f"{type(t).__name__} {t.dtype} {tuple(t.shape)}", t)]
    names, ctx = t.__tensor_flatten__()
    found = [(f"{type(t).__name__} {ctx!r} requires_grad={t.requires_grad}", None)]
    for name in names:
        found += leaves(getattr(t, name))
    return found


def digest(model) -> tuple[str, int]:
    """A digest of every parameter and buffer (inner tensors and metadata), and their bytes."""
    h = hashlib.sha256()
    held = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        h.update(name.encode())
        for meta, leaf in leaves(t):
            h.update(meta.encode())
            if leaf is not None:
                data = leaf.detach().contiguous().view(-1).view(dtype=__import__("torch").uint8)
                h.update(memoryview(data.numpy()))
                held += leaf.untyped_storage().nbytes()
    return h.hexdigest(), held


def child(argv) -> None:
    import torch
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    from deferinit import deferred
    from deferinit.demo import Llama
    from deferinit.materialize import materialize_module

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    kind, quick = argv[0], "--quick" in argv
    llama = shape(quick)
    config = Int8WeightOnlyConfig()
    gc.collect()
    measured = reset_peak()
    before = status("VmRSS")
    start = time.perf_counter()
    torch.manual_seed(0)
    if kind == "eager":
        model = Llama(llama)
        built = time.perf_counter()
        full = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
        quantize_(model, config)
        record_s, materialize_s = built - start, time.perf_counter() - built
    else:
        with deferred():
            model = Llama(llama)
        full = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
        quantize_(model, config)
        recorded = time.perf_counter()
        materialize_module(model)
        record_s, materialize_s = recorded - start, time.perf_counter() - recorded
    peak = status("VmHWM") - before
    value, held = digest(model)
    largest = max(full, key=full.get)
    print(json.dumps({
        "params": sum(p.numel() for p in model.parameters()) if kind == "eager" else None,
        "full": sum(full.values()), "largest": full[largest], "largest_name": largest,
        "peak": peak if measured else -1, "held": held, "digest": value,
        "record_s": record_s, "materialize_s": materialize_s,
    }))


def main(quick: bool = False) -> str:
    script = os.path.abspath(__file__)
    flags = ["--quick"] if quick else []
    before = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by the children at start
    try:
        deferred = run_child(script, "child", "deferred", *flags)
        eager = run_child(script, "child", "eager", *flags)
    finally:
        if before is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = before
    bound = deferred["held"] + 1.2 * deferred["largest"]
    rows = [
        ["eager: construct, then quantize_", f"{eager['record_s']:.1f} s", f"{eager['materialize_s']:.1f} s",
         f"{eager['peak'] / MiB:,.0f} MiB", f"{eager['peak'] / bound:.2f}", "(reference)"],
        ["deferred: quantize_, then materialize_module", f"{deferred['record_s']:.1f} s",
         f"{deferred['materialize_s']:.1f} s", f"{deferred['peak'] / MiB:,.0f} MiB",
         f"{deferred['peak'] / bound:.2f}", "equal" if deferred["digest"] == eager["digest"] else "DIFFERENT"],
    ]
    lines = [
        f"Machine: {machine()}.",
        "",
        f"Model: {shape(quick).describe()}; {eager['params'] / 1e9:.2f}e9 parameters, "
        f"{eager['full'] / MiB:,.0f} MiB in float32; torchao `Int8WeightOnlyConfig`. "
        f"Quantized model: {deferred['held'] / MiB:,.0f} MiB; largest full-precision tensor: "
        f"`{deferred['largest_name']}`, {deferred['largest'] / MiB:,.0f} MiB. "
        f"Bound: quantized model + 1.2 x largest = {bound / MiB:,.0f} MiB.",
        "",
        table(
            ["", "build (eager) / record + quantize_ (deferred)", "quantize_ (eager) / materialize",
             "peak RSS above start", "peak / bound", "values"],
            rows,
        ),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(sys.argv[2:])
    else:
        print(main(quick="--quick" in sys.argv))
