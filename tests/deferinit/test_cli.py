"""The ``deferinit`` command line (issue 5), every command run in a subprocess.

Numbers in the tables are checked against the same model built eagerly.
"""

import concurrent.futures
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import torch

from clirun import row, run

ROOT = pathlib.Path(__file__).resolve().parents[2]
HAS_DOT = shutil.which("dot") is not None
needs_dot = pytest.mark.skipif(not HAS_DOT, reason="Graphviz's `dot` program is not installed (apt-get install graphviz)")


def flat(out: str) -> str:
    """``out`` with runs of spaces as one: the table's columns are as wide as its longest label."""
    return " ".join(out.split())


def kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"


def test_inspect_counts_bytes_largest_layer_adam_and_shards(tmp_path):
    r = run("inspect", "torch.nn:TransformerEncoderLayer", 64, "-k", "nhead=4", "-k", "dim_feedforward=256",
            "--shard", "4", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    eager = torch.nn.TransformerEncoderLayer(64, nhead=4, dim_feedforward=256)
    numel = sum(p.numel() for p in eager.parameters())
    tensors = len(list(eager.parameters()))
    assert row(r.stdout, "parameters")[1:] == [f"{tensors:,}", f"{numel:,}", kib(4 * numel)]
    assert row(r.stdout, "float32")[1:] == [f"{tensors:,}", f"{numel:,}", kib(4 * numel)]
    assert row(r.stdout, "buffers")[1:] == ["0", "0", "0 B"]
    # The module with the most bytes of its own parameters.
    own = {n: sum(p.numel() for p in m.parameters(recurse=False)) for n, m in eager.named_modules()}
    big = max(own, key=own.get)
    assert f"{big} ({type(eager.get_submodule(big)).__name__}): {own[big]:,} parameters" in r.stdout
    said = flat(r.stdout)
    assert f"train with Adam {kib(16 * numel)} = 16 B x {numel:,} parameters (float32 weights" in said
    assert f"sharded over 4 {kib(16 * numel / 4)} per device" in said and "fp32 masters" not in said
    assert "deferral took" in said and "devices cpu" in said


def test_inspect_dtype_device_and_positional_arguments(tmp_path):
    r = run("inspect", "torch.nn:Linear", 256, 128, "--dtype", "bfloat16", "--device", "cuda", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    numel = 256 * 128 + 128
    assert row(r.stdout, "bfloat16")[1:] == ["2", f"{numel:,}", kib(2 * numel)]
    assert "devices cuda:0" in flat(r.stdout)  # no CUDA needed


def test_inspect_a_file_target_without_device_argument(tmp_path):
    (tmp_path / "models.py").write_text(
        "import torch\n"
        "def build(width, depth=2, act='relu'):\n"
        "    assert act == 'gelu'\n"
        "    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])\n"
    )
    # build() takes no device=: --device becomes a torch.device context.
    r = run("inspect", "models.py:build", 8, "-k", "depth=3", "-k", "act=gelu", "--device", "cuda", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert row(r.stdout, "parameters")[1:3] == ["6", f"{3 * (8 * 8 + 8):,}"]
    assert "cuda:0" in r.stdout
    # And as module:callable, importable from the current directory.
    r = run("inspect", "models:build", 8, "-k", "act='gelu'", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert row(r.stdout, "parameters")[1:3] == ["4", f"{2 * (8 * 8 + 8):,}"]


def test_inspect_transformers_with_config_offline(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = dict(
        model_type="llama", vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    r = run("inspect", "transformers:LlamaForCausalLM", "--config", "cfg.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    eager = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_dict(cfg))
    numel = sum(p.numel() for p in eager.parameters())
    buffers = sum(b.numel() for b in eager.buffers())
    assert row(r.stdout, "parameters")[2] == f"{numel:,}"
    assert row(r.stdout, "buffers")[2] == f"{buffers:,}"
    assert "model.embed_tokens (Embedding)" in r.stdout or "lm_head (Linear)" in r.stdout


SMALL_LLAMA = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
)


def _eager_rows(config, dtype):
    """``{dtype name: (tensors, elements)}`` of the parameters of LlamaForCausalLM
    built eagerly under default dtype ``dtype``, as from_pretrained(dtype=...) does."""
    import transformers

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        eager = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    rows = {}
    for p in eager.parameters():
        name = str(p.dtype).replace("torch.", "")
        t, n = rows.get(name, (0, 0))
        rows[name] = (t + 1, n + p.numel())
    return rows


def _hf_cache_with(tmp_path, repo: str, config: dict) -> pathlib.Path:
    """A Hugging Face hub cache (its documented layout) holding ``repo``'s config.json."""
    hub = tmp_path / "hub"
    snapshot = hub / f"models--{repo.replace('/', '--')}" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abcd")
    return hub


def test_inspect_config_directory_file_and_cached_model_id_honour_the_config_dtype(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**SMALL_LLAMA)
    config.dtype = torch.bfloat16
    config.save_pretrained(tmp_path / "saved")            # a directory, as save_pretrained writes it
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    old_style = {k: v for k, v in saved.items() if k != "dtype"}
    old_style["torch_dtype"] = "float16"                  # the key older transformers wrote
    (tmp_path / "old.json").write_text(json.dumps(old_style))
    hub = _hf_cache_with(tmp_path, "acme/tiny-llama", saved)

    cases = [
        (("--config", "saved"), None, torch.bfloat16, "bfloat16 (the config's dtype; --dtype overrides it)"),
        (("--config", "saved", "--dtype", "float32"), None, torch.float32, "float32 (--dtype)"),
        (("--config", "old.json"), None, torch.float16, "float16 (the config's torch_dtype"),
        (("--config", "acme/tiny-llama"), {"HF_HUB_CACHE": str(hub)}, torch.bfloat16, "bfloat16 (the config's dtype"),
    ]
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        runs = list(pool.map(
            lambda case: run("inspect", "transformers:LlamaForCausalLM", *case[0], cwd=tmp_path, env_extra=case[1]),
            cases,
        ))
    for (args, env, dtype, said), r in zip(cases, runs):
        assert r.returncode == 0, (args, r.stderr)
        assert f"built with dtype {said}" in flat(r.stdout), (args, r.stdout)
        for name, (tensors, numel) in _eager_rows(config, dtype).items():
            assert row(r.stdout, name)[1:3] == [f"{tensors:,}", f"{numel:,}"], (args, name, r.stdout)


def test_inspect_without_config_dtype_says_pytorch_default(tmp_path):
    r = run("inspect", "torch.nn:Linear", 8, 8, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "built with dtype float32 (PyTorch default)" in flat(r.stdout)


def test_graph_writes_dot_by_extension(tmp_path):
    r = run("graph", "torch.nn:Embedding", 10, 4, "-k", "padding_idx=0", "-o", "emb.dot", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    source = (tmp_path / "emb.dot").read_text()
    assert source.startswith("digraph")
    for text in ("aten.normal_", "aten.select.int", "aten.fill_.Scalar", "weight\\n[10, 4] float32 cpu"):
        assert text in source
    assert "wrote emb.dot" in r.stdout


def test_graph_options_module_depth_expand(tmp_path):
    (tmp_path / "tiny.py").write_text(
        "from deferinit.demo import Llama, LLAMA_TINY\ndef build(): return Llama(LLAMA_TINY)\n"
    )
    r = run("graph", "tiny.py:build", "--module", "layers.1", "-o", "one.dot", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    one = (tmp_path / "one.dot").read_text()
    assert "layers.1.mlp.up_proj.weight" in one and "layers.0." not in one
    r = run("graph", "tiny.py:build", "--depth", "1", "--expand", "--no-legend", "-o", "d.gv", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    folded = (tmp_path / "d.gv").read_text()
    assert "aten." not in folded and "ModuleList" in folded and "legend" not in folded


@needs_dot
def test_graph_renders_svg(tmp_path):
    (tmp_path / "enc.py").write_text(
        "import torch\n"
        "def build(n):\n"
        "    return torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(32, 2, 64), n, enable_nested_tensor=False)\n"
    )
    r = run("graph", "enc.py:build", 5, "-o", "enc.svg", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    svg = (tmp_path / "enc.svg").read_text()
    assert "<svg" in svg and "x5" in svg and "layers.0.linear1.weight" in svg


def test_graph_without_graphviz_writes_the_source_and_says_how_to_install(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    r = run("graph", "torch.nn:Linear", 4, 3, "-o", "lin.svg", cwd=tmp_path, path=str(bin_dir))
    assert r.returncode == 1
    assert "apt-get install graphviz" in r.stderr and "lin.dot" in r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert (tmp_path / "lin.dot").read_text().startswith("digraph")
    assert not (tmp_path / "lin.svg").exists()


def test_demo_tiny(tmp_path):
    r = run("demo", "--size", "tiny", "-o", "demo.dot", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bit-identical" in r.stdout and "DIFFERENT" not in r.stdout
    assert "x4" in (tmp_path / "demo.dot").read_text()


@pytest.mark.slow
def test_demo_70b(tmp_path):
    r = run("demo", cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "70,553,706,496" in r.stdout and "the 9 tensors are bit-identical" in r.stdout
    graph = tmp_path / ("deferinit-demo.svg" if HAS_DOT else "deferinit-demo.dot")
    assert graph.exists()


BAD_INPUT = [
    (("inspect", "no_such_module_xyz:Model"), "cannot import module 'no_such_module_xyz'"),
    (("inspect", "torch.nn:Lineer", 3, 3), "torch.nn has no attribute 'Lineer'; did you mean Linear"),
    (("inspect", "torch.nn"), "TARGET must be module:callable"),
    (("inspect", "torch:pi"), "is a float, not a callable"),
    (("inspect", "torch.nn:Linear", 3, "-k", "bias"), "-k expects name=value"),
    (("inspect", "torch.nn:Linear", 3, "-k", "out_features=3+"), "-k out_features: cannot parse '3+'"),
    (("inspect", "torch.nn:Linear", 3, "-k", "2x=1"), "is not a valid argument name"),
    (("inspect", "torch.nn:Linear", 3, 3, "-k", "bias=false"), "'false' looks like False"),
    (("inspect", "torch.nn:Linear", 3, "3", "--dtype", "int7"), "--dtype 'int7'"),
    (("inspect", "torch.nn:Linear", 3, "3", "--config", "missing.json"), "--config missing.json"),
    (("inspect",), "missing TARGET"),
    (("graph", "torch.nn:Linear", 3, 3, "-o", "x.jpg"), "the extension must be one of"),
    (("graph", "torch.nn:Linear", 3, 3, "--module", "nope", "-o", "x.dot"), "has no submodule 'nope'"),
    (("frobnicate",), "invalid choice: 'frobnicate'"),
    (("inspect", "torch.nn:Linear", 3, "--dtype", "float32", 3, "--bogus"), "unrecognized arguments: 3 --bogus"),
    (("inspect", "torch.nn:Linear", 4, 4, 5, 6), "the positional value 6 lands in parameter 'device' of Linear("),
    (("inspect", "torch.nn:Linear", 4, 4, 5, 6, 7, 8), "too many positional values"),
    (("inspect", "torch.nn:Linear", 4), "missing argument 'out_features'"),
    (("inspect", "transformers:LlamaForCausalLM"), "missing argument 'config' of LlamaForCausalLM(config); pass a config with --config"),
    (("inspect", "transformers:LlamaForCausalLM", "--config", "no/such-model"), "nor a model id whose config.json is in the local Hugging Face cache"),
    (("inspect", "transformers:LlamaForCausalLM", "--config", "."), "the directory has no config.json"),
    (("demo", "-o", "/missing/dir/x.svg"), "the directory /missing/dir does not exist"),
    (("demo", "-o", "x.jpg"), "the extension must be one of"),
    (("graph", "torch.nn:Linear", 3, 3, "-o", "/missing/dir/x.dot"), "the directory /missing/dir does not exist"),
]


@pytest.fixture(scope="module")
def bad_input_runs(tmp_path_factory):
    """All the bad-input commands, run concurrently once (each is a fresh Python)."""
    cwd = tmp_path_factory.mktemp("bad")
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        futures = [pool.submit(run, *args, cwd=cwd) for args, _ in BAD_INPUT]
        return [f.result() for f in futures]


@pytest.mark.parametrize("case", range(len(BAD_INPUT)), ids=[" ".join(map(str, a)) for a, _ in BAD_INPUT])
def test_bad_input_is_one_line_and_status_2(bad_input_runs, case):
    args, message = BAD_INPUT[case]
    r = bad_input_runs[case]
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.startswith("deferinit: error: ") and message in r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert r.stdout == ""   # refused before any work (the demo prints its steps as it goes)


def test_constructor_that_raises_is_one_line_unless_debug(tmp_path):
    r = run("inspect", "torch.nn:Linear", -3, 3, cwd=tmp_path)
    assert r.returncode == 1
    assert r.stderr.startswith("deferinit: error: torch.nn:Linear(-3, 3) raised RuntimeError: ")
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    r = run("inspect", "torch.nn:Linear", -3, 3, "--debug", cwd=tmp_path)
    assert r.returncode != 0 and "Traceback" in r.stderr and "negative dimension" in r.stderr


def test_installed_console_script(tmp_path):
    script = pathlib.Path(sys.executable).with_name("deferinit")
    if not script.exists():
        pytest.skip("the deferinit console script is not installed in this environment (pip install -e .)")
    r = subprocess.run([str(script), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "inspect" in r.stdout and "graph" in r.stdout and "demo" in r.stdout
