"""``deferinit plan`` (issue 13), run in a subprocess as a user would.

The figures it prints are checked against the same step measured in this
process on a real model: PyTorch's MemTracker and FlopCounterMode over the
real CPU run.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from deferinit.cli.planreport import fmt_flops
from deferinit.cli.step import measure_step
from deferinit.demo import LLAMA_TINY, Llama
from deferinit.text import fmt_bytes

ROOT = pathlib.Path(__file__).resolve().parents[2]

TARGETS = '''
import torch.nn as nn
from deferinit.demo import Llama, LLAMA_TINY

def tiny(device=None, dtype=None):
    return Llama(LLAMA_TINY, device=device, dtype=dtype)

def tiny_bf16(device=None):
    import torch
    return Llama(LLAMA_TINY, device=device, dtype=torch.bfloat16)  # whatever --dtype says

class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))
'''


def plan(*args, cwd, timeout=600):
    env = dict(os.environ, PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "deferinit", "plan", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def cells(out: str, label: str) -> list[str]:
    for line in out.splitlines():
        if line.strip().startswith(label + "  ") or line.strip() == label:
            return re.split(r"\s{2,}", line.strip())
    raise AssertionError(f"no row {label!r} in:\n{out}")


# A transformers config saved in bfloat16, as most checkpoints' configs are.
BF16_CONFIG = (
    '{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, '
    '"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256, '
    '"max_position_embeddings": 128, "torch_dtype": "bfloat16"}'
)


@pytest.fixture()
def targets(tmp_path):
    (tmp_path / "targets.py").write_text(TARGETS)
    (tmp_path / "bf16").mkdir()
    (tmp_path / "bf16" / "config.json").write_text(BF16_CONFIG)
    return tmp_path


def test_plan_prints_the_real_runs_peak_per_category_and_module(targets):
    r = plan("targets.py:tiny", "--batch", "2x16", "--device", "cpu", cwd=targets)
    assert r.returncode == 0, r.stderr
    torch.manual_seed(0)
    model = Llama(LLAMA_TINY)
    ids = torch.randint(0, LLAMA_TINY.vocab_size, (2, 16))
    real = measure_step(model, (ids,), {}, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False), token_ids=ids)
    peak = real.peak[torch.device("cpu")]
    out = r.stdout
    assert "one training step (forward, backward, AdamW step) on fake cpu" in out
    after = real.after[torch.device("cpu")]
    for category, label in [("PARAM", "parameters"), ("GRAD", "gradients"), ("OPT", "optimizer state"),
                            ("ACT", "activations"), ("Total", "total")]:
        expected = [fmt_bytes(snap[category]) if snap.get(category) else "-" for snap in (peak, after)]
        assert cells(out, label)[1:3] == expected, label
    assert cells(out, "layers.0-3 (4 x DecoderLayer)")[1] == fmt_bytes(
        sum(p.numel() * 4 for layer in model.layers for p in layer.parameters()))
    assert f"FLOPs per step (FlopCounterMode): {fmt_flops(real.flops)} ({real.flops:,})" in out
    for row in ("(whole model)", "embed_tokens", "norm", "lm_head"):
        assert cells(out, row)[2] in ("forward", "backward")


def test_plan_on_fake_cuda_with_fsdp2_shows_one_rank(targets):
    r = plan("targets.py:tiny", "--batch", "2x16", "--shard", "4", "--rank", "1", "--dtype", "bfloat16", cwd=targets)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "on fake cuda:0, rank 1 of 4 (FSDP2, fake process group)" in out and "FSDPMemTracker" in out
    shard = sum(p.numel() * 2 for p in Llama(LLAMA_TINY).parameters()) / 4
    local = cells(out, "parameters (local shard)")[1]
    assert local.endswith("KiB") and abs(float(local.split()[0]) * 1024 - shard) < 0.06 * shard  # padding aside
    for label in ("parameters (gathered)", "all-gather buffers", "reduce-scatter buffers", "activations"):
        assert cells(out, label)
    assert "AdamW foreach step" in out  # what PyTorch picks for CUDA tensors


def test_plan_takes_other_inputs_and_optimizers(targets):
    r = plan("targets.py:CNN", "--input", "4x3x16x16", "--optimizer", "sgd", "--no-foreach", cwd=targets)
    assert r.returncode == 0, r.stderr
    assert "SGD step" in r.stdout and "inputs 4x3x16x16" in r.stdout
    assert cells(r.stdout, "features")[2] in ("forward", "backward")


def _real_recipe_step():
    """The step of the recipe below in plain PyTorch on an eager model, under MemTracker."""
    from torch.distributed._composable import checkpoint
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    model = Llama(LLAMA_TINY)
    for block in model.layers:
        checkpoint(block)
    ids = torch.randint(0, LLAMA_TINY.vocab_size, (2, 16))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.95), foreach=False)
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        for micro in range(2):
            if micro:
                tracker.reset_mod_stats()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, -2).float(), ids.flatten())
            loss = loss / 2
            loss.backward()
            del loss
        opt.step()
        opt.zero_grad()
        after = tracker.get_tracker_snapshot()[torch.device("cpu")]
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")], after


def test_plan_with_a_training_recipe_prints_the_real_steps_figures(targets):
    r = plan("targets.py:tiny", "--batch", "2x16", "--device", "cpu", "--mixed-precision", "bf16", "--checkpointing",
             "--accumulate", "2", "--optimizer", "adam", "--optimizer-arg", "lr=1e-3", "--optimizer-arg",
             "betas=(0.9,0.95)", "--no-foreach", cwd=targets)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "one training step (2 x (forward, backward), Adam step) on fake cpu" in out
    assert "optimizer arguments lr=0.001, betas=(0.9, 0.95)" in out
    assert "activation checkpointing: torch.distributed._composable.checkpoint on 4 blocks" in out
    assert "mixed precision: bfloat16 compute, float32 master weights (torch.autocast)" in out
    assert "gradient accumulation: 2 micro-batches per step" in out
    peak, after = _real_recipe_step()
    keys = {"_MemRefType.PARAM": "parameters", "_MemRefType.GRAD": "gradients", "_MemRefType.OPT": "optimizer state",
            "_MemRefType.ACT": "activations", "_MemRefType.TEMP": "temporaries", "Total": "total"}
    for key, label in keys.items():
        want = [fmt_bytes(snap[k]) if snap[k] else "-" for snap in (peak, after) for k in snap if str(k) == key]
        if want != ["-", "-"]:  # a category empty throughout has no row
            assert cells(out, label)[1:3] == want, label


def test_plan_says_when_there_are_no_fp32_master_weights(targets):
    r = plan("targets.py:tiny", "--batch", "2x16", "--dtype", "bfloat16", cwd=targets)
    assert r.returncode == 0, r.stderr
    assert ("parameters, gradients and optimizer state in bfloat16: no float32 master weights "
            "(--mixed-precision bf16 with a float32 build plans those)") in r.stdout


def test_plan_of_a_transformers_training_config(tmp_path):
    """use_cache false, as training configs have it: transformers' masking code checks
    position ids made with torch.arange, answered as eagerly."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=500, max_position_embeddings=256, use_cache=False)
    config.save_pretrained(tmp_path / "cfg")
    r = plan("transformers:LlamaForCausalLM", "--config", "cfg", "--batch", "2x128", "--device", "cpu",
             "--no-foreach", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.from_pretrained(tmp_path / "cfg"))
    model.train()
    ids = torch.randint(0, 500, (2, 128))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    assert cells(r.stdout, "total")[1] == fmt_bytes(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


@pytest.mark.parametrize("args, message", [
    (["targets.py:tiny", "--batch", "2x3", "--dtype", "bfloat16", "--mixed-precision", "bf16"],
     "--mixed-precision: mixed precision (bfloat16 compute) keeps float32 master weights, and the model has "
     "bfloat16 parameters: build it in float32 (pass --dtype float32 instead of --dtype bfloat16)"),
    # No --dtype: the config's dtype made it bfloat16, and "drop --dtype" would be no advice.
    (["transformers:LlamaForCausalLM", "--config", "bf16", "--batch", "1x8", "--mixed-precision", "bf16"],
     "bfloat16 parameters: build it in float32 (pass --dtype float32, which overrides the config's torch_dtype)"),
    (["targets.py:tiny_bf16", "--batch", "2x3", "--mixed-precision", "bf16"],
     "bfloat16 parameters: build it in float32 (pass --dtype float32 (the default dtype while building); "
     "parameters the model's code makes in a fixed dtype stay so: plan those without --mixed-precision)"),
    (["targets.py:tiny", "--batch", "2x3", "--mixed-precision", "int8"], "--mixed-precision 'int8': expected bf16 or fp16"),
    (["targets.py:tiny", "--batch", "2x3", "--optimizer", "adamz"], "--optimizer adamz: no optimizer 'adamz' in torch.optim"),
    (["targets.py:tiny", "--batch", "2x3", "--optimizer-arg", "lr"], "--optimizer-arg expects name=value"),
    (["targets.py:tiny", "--batch", "2x3", "--optimizer", "sgd", "--optimizer-arg", "betas=(0.9,0.95)"],
     "--optimizer-arg: SGD takes no argument 'betas' (it takes lr, momentum"),
    (["targets.py:tiny", "--batch", "2x3", "--accumulate", "0"], "--accumulate must be at least 1"),
    (["targets.py:CNN", "--input", "2x3x8x8", "--checkpointing"],
     "--checkpointing checkpoints each block of an nn.ModuleList, and CNN has none"),
    (["torch.nn:Linear", "4", "4"], "plan needs inputs"),
    (["torch.nn:Linear", "4", "4", "--batch", "2x3"], "no nn.Embedding"),
    (["targets.py:tiny", "--batch", "2x"], "expected sizes joined by x"),
    (["targets.py:tiny", "--batch", "2x3x4"], "BATCHxSEQUENCE"),
    (["targets.py:tiny", "--batch", "2x3", "--rank", "1"], "--rank R needs --shard N"),
    (["targets.py:tiny", "--batch", "2x3", "--shard", "0"], "--shard must be at least 1"),
    (["targets.py:CNN", "--input", "2x3x8x8:floaty"], "not a torch dtype"),
])
def test_bad_plan_input_is_one_line_and_status_2(targets, args, message):
    r = plan(*args, cwd=targets)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_plan_of_a_70b_llama_sharded_over_8(tmp_path):
    r = plan("deferinit.demo:Llama", "--dtype", "bfloat16", "--batch", "1x4096", "--shard", "8", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "layers.0-79 (80 x FSDPDecoderLayer)" in out and "rank 0 of 8" in out
    # one rank holds an eighth of the 141 GB of bf16 weights
    assert cells(out, "parameters (local shard)")[1] == fmt_bytes(70553706496 * 2 / 8)
