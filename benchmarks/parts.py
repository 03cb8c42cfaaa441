"""A part costs its part: materializing one piece of a big deferred model, and many small tensors.

Each row times, in fresh processes, eager construction of a piece alone
against materializing that piece of a deferred model, whose earlier draws
the generator must move past (it jumps over them: deferinit/random/jumps.py):

1. one decoder layer (0, and the last) of a deferred Llama-3-8B
   (``transformers.LlamaForCausalLM`` from its config, no weights) against
   eager construction of one ``LlamaDecoderLayer``;
2. layer 79 of the 70B torch.nn Llama of ``deferinit.demo`` against eager
   construction of one of its ``DecoderLayer``;
3. a model of 50,000 small parameters (``randn(4)`` each in a
   ``ParameterList``, or 25,000 ``nn.Linear(4, 4)``), whole, against eager
   construction (materialization must stay linear in the number of tensors);
4. a DeepSeek-V3-shaped mixture of experts (2 layers of 256 routed experts
   and a shared one, each expert three ``nn.Linear``: 1,542 expert tensors,
   at small sizes so that eager fits), whole, against eager: equal values.

Goals: at most 2x eager construction of the piece (rows 1-3).  For row 3
it also times a floor: the least a replay in Python does per tensor
(:func:`floor`), to show how much of the ratio is the work itself.  The
figures of one rank of a sharded model are in ``benchmarks/sharding.py``.

Run: ``python benchmarks/parts.py`` (prints markdown; ``--quick`` for tiny
shapes; ``--only=many,many-linear`` for some rows; ``--repeat=5`` for the
median of 5 runs of each cell, eager and deferred alternately).  Child mode (internal): ``python benchmarks/parts.py child CASE MODE [--quick]``.
"""

from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import machine, mib, peak_rss_bytes, run_child, table  # noqa: E402


def llama8b_config(quick: bool):
    import transformers

    transformers.logging.set_verbosity_error()
    if quick:
        return transformers.LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                        num_attention_heads=8, num_key_value_heads=2)
    return transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False,
    )


def demo_shape(quick: bool):
    from deferinit.demo import LLAMA_70B, LLAMA_TINY

    return LLAMA_TINY if quick else LLAMA_70B


class Many:
    """``n`` small parameters: in one ``nn.ParameterList`` (``randn(4)`` each), or
    as the weights and biases of ``n / 2`` ``nn.Linear(4, 4)``."""

    @staticmethod
    def build(n, linear=False):
        import torch
        import torch.nn as nn

        class Many(nn.Module):
            def __init__(self):
                super().__init__()
                if linear:
                    self.ps = nn.ModuleList(nn.Linear(4, 4) for _ in range(n // 2))
                else:
                    self.ps = nn.ParameterList(nn.Parameter(torch.randn(4)) for _ in range(n))

        return Many()


def moe(quick: bool):
    """A DeepSeek-V3-shaped mixture of experts: per layer a router over 256 routed
    experts plus one shared expert, every expert a SwiGLU of three nn.Linear."""
    import torch
    import torch.nn as nn

    d, inner, experts, layers = (16, 8, 256, 2) if not quick else (8, 4, 32, 2)

    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = nn.Linear(d, inner, bias=False)
            self.up_proj = nn.Linear(d, inner, bias=False)
            self.down_proj = nn.Linear(inner, d, bias=False)

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(d, experts, bias=False)
            self.e_score_correction_bias = nn.Parameter(torch.zeros(experts))
            self.experts = nn.ModuleList(Expert() for _ in range(experts))
            self.shared_experts = Expert()

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(100, d)
            self.layers = nn.ModuleList(MoE() for _ in range(layers))
            for layer in self.layers:  # DeepSeek-style init: normal(0, 0.006) over every Linear
                for m in layer.modules():
                    if isinstance(m, nn.Linear):
                        nn.init.normal_(m.weight, std=0.006)

    return Model()


def floor(model) -> None:
    """The least a replay in Python does for a model of ``randn(4)`` parameters:
    per tensor, its recorded call from the default generator, one
    ``nn.Parameter``, one ``torch.utils.swap_tensors`` into the fake (no plan,
    no checks, no undo, nothing remembered; the fakes swapped out die here, as
    in a materialization).  Only for ``Many.build(n)``, whose draws follow one
    another from the seed; its values equal eager's (the checksum says so)."""
    import torch

    from deferinit.fake.bypass import no_python_dispatch
    from deferinit.fake.flat import unflatten

    gen = torch.default_generator
    with no_python_dispatch(), torch.no_grad():
        for fake in list(model.ps):
            node = fake._value.node
            args, kwargs = unflatten(node.flat, node.spec)
            real = torch.nn.Parameter(torch.randn(*args, generator=gen, **kwargs))
            torch.utils.swap_tensors(fake, real)


def child(case: str, mode: str, quick: bool) -> dict:
    import torch

    from deferinit import deferred_init
    from deferinit.random.jumps import FALLBACKS
    from deferinit.materialize import materialize_module

    torch.set_num_threads(1)
    torch.manual_seed(0)
    result = {}
    if case in ("llama8b-0", "llama8b-last"):
        import transformers
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # imported outside the timings

        config = llama8b_config(quick)
        if mode == "eager":
            start = time.perf_counter()
            layer = LlamaDecoderLayer(config, layer_idx=0)
            result["seconds"] = time.perf_counter() - start
            part = layer
        else:
            model = deferred_init(transformers.LlamaForCausalLM, config)
            index = 0 if case.endswith("-0") else config.num_hidden_layers - 1
            part = model.model.layers[index]
            start, cpu = time.perf_counter(), time.process_time()
            materialize_module(part)
            result["seconds"], result["cpu"] = time.perf_counter() - start, time.process_time() - cpu
    elif case == "demo70b-last":
        from deferinit.demo import DecoderLayer, Llama

        shape = demo_shape(quick)
        if mode == "eager":
            start = time.perf_counter()
            part = DecoderLayer(shape)
            result["seconds"] = time.perf_counter() - start
        else:
            model = deferred_init(Llama, shape)
            part = model.layers[shape.num_layers - 1]
            start, cpu = time.perf_counter(), time.process_time()
            materialize_module(part)
            result["seconds"], result["cpu"] = time.perf_counter() - start, time.process_time() - cpu
    elif case in ("many", "many-linear"):
        n = 2_000 if quick else 50_000
        linear = case == "many-linear"
        if mode == "eager":
            start, cpu = time.perf_counter(), time.process_time()
            part = Many.build(n, linear)
            result["seconds"], result["cpu"] = time.perf_counter() - start, time.process_time() - cpu
        elif mode == "floor":
            part = deferred_init(Many.build, n, linear)
            start, cpu = time.perf_counter(), time.process_time()
            floor(part)
            result["seconds"], result["cpu"] = time.perf_counter() - start, time.process_time() - cpu
        else:
            part = deferred_init(Many.build, n, linear)
            start, cpu = time.perf_counter(), time.process_time()
            materialize_module(part)
            result["seconds"], result["cpu"] = time.perf_counter() - start, time.process_time() - cpu
    elif case == "moe":
        if mode == "eager":
            start, cpu = time.perf_counter(), time.process_time()
            part = moe(quick)
            result["seconds"], result["cpu"] = time.perf_counter() - start, time.process_time() - cpu
        else:
            part = deferred_init(moe, quick)
            start, cpu = time.perf_counter(), time.process_time()
            materialize_module(part)
            result["seconds"], result["cpu"] = time.perf_counter() - start, time.process_time() - cpu
    else:
        raise SystemExit(f"unknown case {case}")
    # Read before the checksum, whose float64 copies would otherwise be the
    # peak (twice the largest tensor, in both processes).
    result["peak_rss"] = peak_rss_bytes()
    tensors = [t for t in part.state_dict().values()]
    result["tensors"] = len(tensors)
    result["params"] = sum(t.numel() for t in tensors)
    # A checksum of the bits: equal values give equal sums, in the same order.
    result["checksum"] = float(sum(t.double().sum() * (i + 1) for i, t in enumerate(tensors)))
    result["fallbacks"] = dict(FALLBACKS)
    return result


CASES = [
    ("llama8b-0", "layer 0 of a deferred Llama-3-8B (transformers)", "one `LlamaDecoderLayer`", False),
    ("llama8b-last", "layer 31 of the same", "one `LlamaDecoderLayer`", False),
    ("demo70b-last", "layer 79 of the 70B `deferinit.demo` Llama (torch.nn, fp32)", "one `DecoderLayer`", False),
    ("many", "50,000 small parameters (`randn(4)` in a ParameterList), whole model", "the whole model", True),
    ("many-linear", "50,000 small parameters (25,000 `nn.Linear(4, 4)`), whole model", "the whole model", True),
    ("moe", "DeepSeek-V3-shaped MoE: 2 layers x 256 experts, whole model", "the whole model", True),
]


def _median(results: list) -> dict:
    """One cell from several runs: each time and peak the median of the runs'
    (the checksum the first run's, or None where the runs disagree)."""
    out = dict(results[0])
    for key in ("seconds", "cpu", "peak_rss"):
        if all(key in r for r in results):
            out[key] = sorted(r[key] for r in results)[len(results) // 2]
    if any(r["checksum"] != out["checksum"] for r in results):
        out["checksum"] = None
    return out


def main(quick: bool = False, only=None, repeat: int = 1) -> str:
    script = os.path.abspath(__file__)
    flags = ["--quick"] if quick else []
    rows = []
    notes = set()
    cpu, floors = [], []
    for case, label, reference, comparable in CASES:
        if only is not None and case not in only:
            continue
        # Alternately, so that a change of the machine's load meets both sides.
        runs = [(run_child(script, "child", case, "eager", *flags), run_child(script, "child", case, "deferred", *flags))
                for _ in range(repeat)]
        eager, deferred = _median([e for e, _ in runs]), _median([d for _, d in runs])
        if "cpu" in eager and "cpu" in deferred:
            cpu.append(f"{label}: {eager['cpu']:.2f} s against {deferred['cpu']:.2f} s, "
                       f"{deferred['cpu'] / eager['cpu']:.2f}x")
        if case == "many":
            least = _median([run_child(script, "child", case, "floor", *flags) for _ in range(repeat)])
            floors.append(f"{label}: {least['cpu']:.2f} s of CPU, {least['cpu'] / eager['cpu']:.2f}x eager's "
                          f"(same values: {'yes' if least['checksum'] == eager['checksum'] is not None else 'NO'})")
        same = "yes" if deferred["checksum"] == eager["checksum"] is not None else "NO"
        notes.update(f"`{k}` ({v})" for k, v in deferred["fallbacks"].items())
        rows.append([
            label, f"{deferred['params'] / 1e6:,.1f} M in {deferred['tensors']:,} tensors", reference,
            f"{eager['seconds']:.2f} s", f"{deferred['seconds']:.2f} s", f"{deferred['seconds'] / eager['seconds']:.2f}x",
            mib(eager["peak_rss"]), mib(deferred["peak_rss"]),
            same if comparable else "(another layer's values)",
        ])
    fallbacks = ", ".join(sorted(notes)) if notes else "none"
    return "\n".join([
        f"Machine: {machine()}, one thread",
        "",
        table(["materialized", "size", "eager reference", "eager", "materialize", "ratio", "eager peak RSS",
               "deferred peak RSS", "same values"], rows),
        "",
        ("Each cell from its own fresh process" if repeat == 1 else
         f"Each cell the median of {repeat} fresh processes, eager and deferred run alternately")
        + ". Goal: ratio at most 2x. The single layers are compared with eager "
        "construction of one layer alone, whose values are not the model's layer (those are checked against "
        "eager construction of whole models in tests/materialize). Draws generated instead of jumped over "
        f"(their word counts not known): {fallbacks}.",
        "",
        "CPU time of the same processes (`time.process_time`, less sensitive to the machine's load), "
        "eager construction against materialization: " + ("; ".join(cpu) or "none") + ".",
    ] + ([
        "",
        "The least a replay in Python does per tensor (`floor` in this script: its recorded call, one "
        "`nn.Parameter`, one `torch.utils.swap_tensors`; no plan, check, undo or bookkeeping): "
        + "; ".join(floors) + ".",
    ] if floors else []))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        print(json.dumps(child(sys.argv[2], sys.argv[3], "--quick" in sys.argv)))
    else:
        only = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--only=")), None)
        repeat = next((int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--repeat=")), 1)
        print(main(quick="--quick" in sys.argv, only=only, repeat=repeat))
