"""Deferral of a 70B Llama-shaped model, side by side with the alternatives.

For the plain ``torch.nn`` model (``deferinit.demo.Llama`` at Llama 3 70B
sizes) and for ``transformers.LlamaForCausalLM`` with the same sizes, it
times construction, warm, under:

* ``torch.device("meta")``: no memory, but nothing is recorded (and
  transformers skips its weight init on meta);
* ``deferred_init``: no memory, every tensor's recipe recorded;
* PyTorch's own ``FakeTensorMode``.

and measures how much resident memory a deferred 70B model holds.  The goal
of the project: deferral at most 1.25x the meta-device time for the torch.nn
model and 1.5x for transformers' (which records the weight initialization
the meta device skips), faster than FakeTensorMode, resident memory growth
under 64 MiB.

Run: ``python benchmarks/defer_70b.py`` (prints markdown).
"""

from __future__ import annotations

import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from _common import machine, mib, rss_bytes, table, timed_together  # noqa: E402
from deferinit import deferred_init  # noqa: E402
from deferinit.demo import LLAMA_70B, Llama  # noqa: E402


def plain_llama():
    return Llama(LLAMA_70B)


def hf_llama_factory():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        vocab_size=LLAMA_70B.vocab_size,
        hidden_size=LLAMA_70B.hidden_size,
        intermediate_size=LLAMA_70B.intermediate_size,
        num_hidden_layers=LLAMA_70B.num_layers,
        num_attention_heads=LLAMA_70B.num_heads,
        num_key_value_heads=LLAMA_70B.num_kv_heads,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    )
    return lambda: transformers.LlamaForCausalLM(config)


def on_meta(build):
    def run():
        with torch.device("meta"):
            return build()

    return run


def under_fake_tensor_mode(build):
    from torch._subclasses.fake_tensor import FakeTensorMode

    def run():
        with FakeTensorMode():
            return build()

    return run


def deferred(build):
    return lambda: deferred_init(build)


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def memory_growth(build) -> tuple[int, int]:
    """Bytes a deferred model and its record keep alive: ``(resident, Python heap)``.

    A first model is built and kept, so that the second one cannot reuse
    memory the allocator got back from a dropped one.
    """
    import tracemalloc

    warm = deferred_init(build)  # imports, caches, allocator pools
    gc.collect()
    before = rss_bytes()
    tracemalloc.start()
    model = deferred_init(build)
    gc.collect()
    heap = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    grown = rss_bytes() - before
    del model, warm
    return grown, heap


def main(repeat: int = 9) -> str:
    lines = [f"Machine: {machine()}", ""]
    models = [("torch.nn Llama-70B", plain_llama)]
    try:
        models.append(("transformers LlamaForCausalLM-70B", hf_llama_factory()))
    except ImportError:
        lines.append("(transformers not installed: its row is skipped)")
    rows = []
    for label, build in models:
        wraps = {"meta device": on_meta, "deferred_init": deferred, "FakeTensorMode": under_fake_tensor_mode}
        best = timed_together({method: wrap(build) for method, wrap in wraps.items()}, repeat=repeat)
        params = count_params(best["meta device"][2])
        best = {method: b[:2] for method, b in best.items()}
        growth, heap = memory_growth(build)
        meta, ours, fake = best["meta device"][0], best["deferred_init"][0], best["FakeTensorMode"][0]
        rows.append(
            [
                label,
                f"{params / 1e9:.2f} B",
                f"{meta * 1e3:.1f} ms",
                f"{ours * 1e3:.1f} ms",
                f"{fake * 1e3:.1f} ms",
                f"{ours / meta:.2f}x",
                f"{ours / fake:.2f}x",
                mib(growth),
                mib(heap),
            ]
        )
    lines.append(
        table(
            ["model", "params", "meta device", "deferred_init", "FakeTensorMode", "deferred / meta", "deferred / FakeTensorMode", "RSS held", "Python heap held"],
            rows,
        )
    )
    lines.append("")
    lines.append(f"Best of {repeat} warm runs each, the three builds taking turns. Goals: deferred / meta <= 1.25x "
                 "for torch.nn and <= 1.5x for transformers, deferred / FakeTensorMode < 1x, RSS < 64 MiB.")
    lines.append(
        "transformers skips its weight initialization on the meta device, so its meta column "
        "builds the modules only, while deferred_init also records every initializer."
    )
    return "\n".join(lines)


if __name__ == "__main__":
    print(main())
