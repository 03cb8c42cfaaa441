"""``--config`` for any factory that takes a config (transformers' ``from_config``
and Auto classes, diffusers' ``ConfigMixin`` classes), whole error messages,
and what ``inspect``'s training estimate assumes (issue 20).

Every command runs in a subprocess as a user types it; the counts it prints
are checked against the same model built eagerly by the library itself
(``AutoModelForCausalLM.from_config``, ``UNet2DConditionModel.from_config``),
and the Adam estimate against a real AdamW step.
"""

import concurrent.futures
import json

import pytest
import torch

from clirun import row, run

transformers = pytest.importorskip("transformers")

TINY_LLAMA = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
)
TINY_UNET = dict(
    sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32,
)


def _rows(model) -> dict:
    """``{dtype name: (tensors, elements)}`` of ``model``'s parameters (ties once)."""
    out = {}
    for p in model.parameters():
        name = str(p.dtype).replace("torch.", "")
        t, n = out.get(name, (0, 0))
        out[name] = (t + 1, n + p.numel())
    return out


def _assert_rows(stdout: str, eager, what) -> None:
    for name, (tensors, numel) in _rows(eager).items():
        assert row(stdout, name)[1:3] == [f"{tensors:,}", f"{numel:,}"], (what, name, stdout)
    assert row(stdout, "parameters")[2] == f"{sum(p.numel() for p in eager.parameters()):,}", (what, stdout)


def _run_all(cases, cwd):
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(lambda args: run(*args, cwd=cwd), cases))


def test_transformers_from_config_factories_take_the_config(tmp_path):
    config = transformers.LlamaConfig(**TINY_LLAMA)
    config.dtype = torch.bfloat16
    config.save_pretrained(tmp_path / "llama")
    cases = [
        ("inspect", "transformers:AutoModelForCausalLM.from_config", "--config", "llama"),
        ("inspect", "transformers:AutoModel.from_config", "--config", "llama/config.json"),
        ("inspect", "transformers:LlamaForCausalLM._from_config", "--config", "llama"),
        ("inspect", "transformers:AutoModelForCausalLM.from_config", "--config", "llama", "--dtype", "float32"),
    ]
    runs = _run_all(cases, tmp_path)
    # Eagerly, by transformers itself: from_config builds under the config's dtype, or the dtype asked for.
    load = lambda: transformers.AutoConfig.from_pretrained(tmp_path / "llama")  # noqa: E731
    eager = [
        transformers.AutoModelForCausalLM.from_config(load()),
        transformers.AutoModel.from_config(load()),
        transformers.LlamaForCausalLM._from_config(load()),
        transformers.AutoModelForCausalLM.from_config(load(), dtype=torch.float32),
    ]
    for args, r, model in zip(cases, runs, eager):
        assert r.returncode == 0, (args, r.stderr)
        _assert_rows(r.stdout, model, args)
    assert "built with dtype bfloat16 (the config's dtype; --dtype overrides it)" in " ".join(runs[0].stdout.split())
    assert "float32 (--dtype)" in runs[3].stdout and "bfloat16" not in runs[3].stdout.split("built with")[0]


def test_diffusers_classes_and_from_config_take_a_diffusers_config(tmp_path):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    diffusers.UNet2DConditionModel(**TINY_UNET).save_config(tmp_path / "unet")
    diffusers.DDPMScheduler(num_train_timesteps=10).save_config(tmp_path / "scheduler")
    cases = [
        ("inspect", "diffusers:UNet2DConditionModel", "--config", "unet"),
        ("inspect", "diffusers:UNet2DConditionModel.from_config", "--config", "unet"),
        ("inspect", "diffusers:AutoModel.from_config", "--config", "unet/config.json"),
        ("inspect", "diffusers:DDPMScheduler", "--config", "scheduler"),   # scheduler_config.json, not a module
        ("inspect", "diffusers:UNet2DConditionModel", "--config", "scheduler"),
    ]
    runs = _run_all(cases, tmp_path)
    eager = diffusers.UNet2DConditionModel.from_config(diffusers.UNet2DConditionModel.load_config(tmp_path / "unet"))
    for args, r in zip(cases[:3], runs[:3]):
        assert r.returncode == 0, (args, r.stderr)
        _assert_rows(r.stdout, eager, args)
    assert runs[0].stdout.startswith("diffusers:UNet2DConditionModel.from_config(<config unet>): built deferred")
    assert runs[3].returncode == 2 and "returned a DDPMScheduler, not an nn.Module" in runs[3].stderr
    assert runs[4].returncode == 2 and "the directory has no config.json" in runs[4].stderr


MODELS = '''
import functools
import torch


def opaque(*args, **kwargs):
    """(*args, **kwargs): the config goes first, the call itself checks the rest."""
    return build(*args, **kwargs)


def build(config, width=4):
    return torch.nn.Linear(config["in"], width)


@functools.wraps(build)
def wrapped(*args, **kwargs):
    return build(*args, **kwargs)


def takes_size(size):
    return torch.nn.Linear(size, 2)


def raises(config):
    raise ValueError("Validation error for field 'in':\\n    TypeError: expected int")
'''


def test_plain_functions_opaque_and_wrapped_signatures(tmp_path):
    (tmp_path / "models.py").write_text(MODELS)
    (tmp_path / "plain.json").write_text(json.dumps({"in": 6}))
    cases = [
        ("inspect", "models.py:opaque", "--config", "plain.json", "-k", "width=3"),
        ("inspect", "models.py:build", "--config", "plain.json"),
        ("inspect", "models.py:wrapped", "--config", "plain.json", 5, 7),   # wraps' signature still checked
        ("inspect", "models.py:takes_size", "--config", "plain.json"),
        ("inspect", "models.py:raises", "--config", "plain.json"),
    ]
    runs = _run_all(cases, tmp_path)
    assert runs[0].returncode == 0, runs[0].stderr
    assert row(runs[0].stdout, "parameters")[2] == f"{6 * 3 + 3:,}"
    assert runs[1].returncode == 0 and row(runs[1].stdout, "parameters")[2] == f"{6 * 4 + 4:,}"
    assert runs[2].returncode == 2
    assert "too many positional values: build(config, width=4) takes at most 2, got 3" in runs[2].stderr
    assert runs[3].returncode == 2 and "cannot tell which config takes_size takes" in runs[3].stderr
    assert "first parameter is not named config, cfg or conf" in runs[3].stderr
    # A constructor's multi-line message, whole, on one line.
    assert runs[4].returncode == 1 and runs[4].stderr.count("\n") == 1
    assert "raised ValueError: Validation error for field 'in': TypeError: expected int" in runs[4].stderr


def test_a_config_transformers_refuses_is_reported_whole(tmp_path):
    base = transformers.LlamaConfig(**TINY_LLAMA).to_dict()
    (tmp_path / "heads.json").write_text(json.dumps({**base, "hidden_size": 65}))
    (tmp_path / "type.json").write_text(json.dumps({**base, "num_attention_heads": "four"}))
    expected = {}
    for name in ("heads", "type"):
        with pytest.raises(Exception) as info:   # what transformers itself says of the file
            transformers.LlamaConfig.from_dict(json.loads((tmp_path / f"{name}.json").read_text()))
        expected[name] = " ".join(line.strip() for line in str(info.value).splitlines() if line.strip())
        assert "\n" in str(info.value)   # the case: a message of several lines
    runs = _run_all([("inspect", "transformers:LlamaForCausalLM", "--config", f"{n}.json") for n in expected], tmp_path)
    for (name, message), r in zip(expected.items(), runs):
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.rstrip("\n").endswith(message), (r.stderr, message)
    assert "The hidden size (65) is not a multiple of the number of attention heads (4)" in runs[0].stderr


# -- what "train with Adam" assumes, against a real AdamW step ----------------------------


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=48, batch_first=True)
        self.norm = torch.nn.BatchNorm1d(32)               # buffers
        self.head = torch.nn.Linear(32, 7, dtype=torch.float32)  # fp32 beside the bf16 ones
        self.layer.norm1.requires_grad_(False)             # frozen: no gradient, no state


def _built(dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return _Net()
    finally:
        torch.set_default_dtype(old)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _adamw_bytes(params, frozen, buffers) -> int:
    """Bytes held after a real AdamW step over ``params``: the parameters, their
    gradients, exp_avg and exp_avg_sq (not the CPU step counters), plus the
    frozen parameters and the buffers."""
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    sum(p.float().sum() for p in params).backward()
    optimizer.step()
    states = [s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert len(states) == 2 * len(params)
    return _nbytes(params) + _nbytes(p.grad for p in params) + _nbytes(states) + _nbytes(frozen) + _nbytes(buffers)


def test_train_with_adam_is_a_real_adamw_step_in_the_parameters_dtype_and_with_fp32_masters():
    from deferinit import deferred_init
    from deferinit.cli.report import format_report, summarize

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        summary = summarize(deferred_init(_Net))
    finally:
        torch.set_default_dtype(old)
    eager = _built(torch.bfloat16)
    trainable = [p for p in eager.parameters() if p.requires_grad]
    frozen = [p for p in eager.parameters() if not p.requires_grad]
    assert {p.dtype for p in trainable} == {torch.bfloat16, torch.float32} and frozen
    # PyTorch's AdamW on the model as built: states in each parameter's dtype.
    assert summary.adam_bytes == _adamw_bytes(trainable, frozen, list(eager.buffers()))
    # Mixed precision: fp32 masters of the trainable parameters take the step.
    masters = [p.detach().float().requires_grad_() for p in trainable]
    assert summary.master_bytes == _adamw_bytes(masters, frozen, list(eager.buffers()))
    text = format_report(summary, None, title="_Net", shard=4)
    from deferinit.text import fmt_bytes

    assert f"+ {fmt_bytes(_nbytes(frozen))} frozen parameters + {fmt_bytes(_nbytes(eager.buffers()))} buffers" in text
    assert "train with Adam    " in text and "each in its parameter's dtype, as `deferinit plan` steps by default" in text
    assert "with fp32 masters  " in text and "sharded over 4" in text and "with fp32 masters)" in text
    # An fp32 model: one figure, both assumptions giving 16 bytes a parameter.
    fp32 = summarize(_built(torch.float32))
    assert fp32.master_bytes is None
    e32 = _built(torch.float32)
    assert fp32.adam_bytes == _adamw_bytes([p for p in e32.parameters() if p.requires_grad],
                                           [p for p in e32.parameters() if not p.requires_grad], list(e32.buffers()))
    assert "with fp32 masters" not in format_report(fp32, None, title="_Net")
