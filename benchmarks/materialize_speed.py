"""Materialization against eager construction: time and peak memory.

Two models: a ~185M-parameter GPT-shaped model in plain ``torch.nn``
(GPT-2 layout, d=1024, 10 layers) and a ``transformers`` Llama of similar
size.  Each figure comes from its own fresh process (peak RSS is per
process): eager construction, versus ``deferred_init`` + ``materialize_module``
on CPU (both timed; the ratio uses materialization alone, and the total).
Goal: time at most 1.0x eager, peak RSS above the import baseline at most
1.0x eager's.

Run: ``python benchmarks/materialize_speed.py`` (prints markdown).
Child mode (used internally): ``python benchmarks/materialize_speed.py child MODEL MODE``.
"""

from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import machine, mib, peak_rss_bytes, rss_bytes, run_child, table  # noqa: E402


def gpt_185m():
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.ln_1 = nn.LayerNorm(d)
            self.attn = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln_2 = nn.LayerNorm(d)
            self.fc = nn.Linear(d, 4 * d)
            self.out = nn.Linear(4 * d, d)

    class GPT(nn.Module):
        def __init__(self, vocab=50257, d=1024, layers=10, context=1024):
            super().__init__()
            self.wte = nn.Embedding(vocab, d)
            self.wpe = nn.Embedding(context, d)
            self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
            self.ln_f = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)
            self.head.weight = self.wte.weight  # tied, as in GPT-2

    return GPT()


def llama_small():
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config)


MODELS = {"gpt-185m (torch.nn)": gpt_185m, "llama (transformers)": llama_small}


def child(model: str, mode: str) -> dict:
    import torch

    build = MODELS[model]
    from deferinit import deferred_init
    from deferinit.materialize import materialize_module

    if model.startswith("llama"):
        import transformers  # noqa: F401  (import cost outside the timings)
    torch.manual_seed(0)
    base = rss_bytes()
    record_s = 0.0
    start = time.perf_counter()
    if mode == "eager":
        m = build()
    else:
        m = deferred_init(build)
        record_s = time.perf_counter() - start
        start = time.perf_counter()
        materialize_module(m)
    seconds = time.perf_counter() - start
    # Read before the checksum, whose float64 copies (the 196 MiB embedding's
    # is 392 MiB) would otherwise be the peak of both processes.
    peak = peak_rss_bytes()
    params = sum(p.numel() for p in m.parameters())
    checksum = float(sum(p.double().sum() for p in m.parameters()))
    return {
        "seconds": seconds,
        "record_s": record_s,
        "peak_rss": peak,
        "base_rss": base,
        "params": params,
        "checksum": checksum,
    }


def main(repeat: int = 3) -> str:
    script = os.path.abspath(__file__)
    rows = []
    for model in MODELS:
        runs = {mode: [run_child(script, "child", model, mode) for _ in range(repeat)] for mode in ("eager", "deferred")}
        best = {mode: min(r["seconds"] for r in rs) for mode, rs in runs.items()}
        record = min(r["record_s"] for r in runs["deferred"])
        peak = {mode: min(r["peak_rss"] for r in rs) for mode, rs in runs.items()}
        grown = {mode: min(r["peak_rss"] - r["base_rss"] for r in rs) for mode, rs in runs.items()}
        same = runs["eager"][0]["checksum"] == runs["deferred"][0]["checksum"]
        rows.append(
            [
                model,
                f"{runs['eager'][0]['params'] / 1e6:.0f} M",
                f"{best['eager']:.2f} s",
                f"{best['deferred']:.2f} s",
                f"{best['deferred'] / best['eager']:.2f}x",
                f"{(best['deferred'] + record) / best['eager']:.2f}x",
                mib(peak["eager"]),
                mib(peak["deferred"]),
                f"{peak['deferred'] / peak['eager']:.2f}x",
                f"{grown['deferred'] / max(grown['eager'], 1):.2f}x",
                "yes" if same else "NO",
            ]
        )
    return "\n".join(
        [
            f"Machine: {machine()}",
            "",
            table(
                [
                    "model",
                    "params",
                    "eager",
                    "materialize",
                    "time ratio",
                    "ratio incl. deferral",
                    "eager peak RSS",
                    "deferred peak RSS",
                    "peak RSS ratio",
                    "ratio above import baseline",
                    "same values",
                ],
                rows,
            ),
            "",
            f"Best of {repeat} fresh processes per cell; CPU, float32. Goals: time <= 1.0x, peak RSS above the import baseline <= 1.0x.",
        ]
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        print(json.dumps(child(sys.argv[2], sys.argv[3])))
    else:
        print(main())
