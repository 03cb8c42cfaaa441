"""load_checkpoint with other libraries' load hooks, and the key mismatch a
common prefix explains (issues 18 and 20), against the libraries' own loading.

Tiny models are saved locally (``save_pretrained``, safetensors); nothing is
downloaded.
"""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from safetensors.torch import save_file  # noqa: E402

from deferinit import CheckpointMismatchError, deferred_init  # noqa: E402
from helpers import assert_same_tensors  # noqa: E402
from deferinit.materialize import LoadResult, load_checkpoint, materialize_module  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")


def llama_config():
    return transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )


def mamba_config():
    return transformers.MambaConfig(
        vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=2, time_step_rank=4,
    )


@pytest.mark.parametrize("mode", ["real", "deferred"])
def test_mamba_load_hook_renames_old_embedding_keys_as_eagerly(mode, tmp_path):
    """MambaModel registers a load_state_dict pre-hook that maps ``embedding.`` to
    ``embeddings.`` (older checkpoints): a strict load of such a checkpoint works."""
    torch.manual_seed(1)
    trained = transformers.MambaModel(mamba_config())
    sd = {("embedding.weight" if k == "embeddings.weight" else k): v.clone() for k, v in trained.state_dict().items()}
    path = str(tmp_path / "old.safetensors")
    save_file(sd, path)
    torch.manual_seed(0)
    eager = transformers.MambaModel(mamba_config())
    result = eager.load_state_dict(dict(sd), strict=True)
    torch.manual_seed(0)
    cls, config = transformers.MambaModel, mamba_config()
    m = cls(config) if mode == "real" else deferred_init(cls, config)
    assert load_checkpoint(m, path, strict=True) == tuple(result) == ([], [])
    materialize_module(m)
    assert_same_tensors(eager, m)


@pytest.mark.parametrize("mode", ["real", "deferred"])
def test_timm_batchnorm_act_without_num_batches_tracked(mode, tmp_path):
    """timm's BatchNormAct2d (a BatchNorm2d with its own state-dict handling)
    loads an old checkpoint as its load_state_dict does."""
    timm_layers = pytest.importorskip(
        "timm.layers", reason="timm cannot be imported here: it needs torchvision, whose wheels need a CUDA torch"
    )
    torch.manual_seed(1)
    trained = timm_layers.BatchNormAct2d(4)
    sd = {k: v.clone() + 1 for k, v in trained.state_dict().items() if "num_batches" not in k}
    path = str(tmp_path / "bn.safetensors")
    save_file(sd, path)
    eager = timm_layers.BatchNormAct2d(4)
    result = eager.load_state_dict(dict(sd), strict=False)
    m = timm_layers.BatchNormAct2d(4) if mode == "real" else deferred_init(timm_layers.BatchNormAct2d, 4)
    assert load_checkpoint(m, path, strict=False) == tuple(result)
    materialize_module(m)
    assert_same_tensors(eager, m)


@pytest.fixture
def causal_lm_dir(tmp_path):
    torch.manual_seed(42)
    transformers.LlamaForCausalLM(llama_config()).save_pretrained(tmp_path / "causal")
    torch.manual_seed(43)
    transformers.LlamaModel(llama_config()).save_pretrained(tmp_path / "base")
    return str(tmp_path / "causal"), str(tmp_path / "base")


def test_a_common_prefix_is_named_with_the_argument_that_fixes_it(causal_lm_dir):
    causal, _ = causal_lm_dir
    m = deferred_init(transformers.LlamaModel, llama_config())
    with pytest.raises(CheckpointMismatchError) as info:
        load_checkpoint(m, causal)
    message = str(info.value)
    assert "with 'model.' in front" in message and "pass prefix='model.'" in message
    # The key lists are cut: a count and the first few, not every key.
    assert "20 missing keys: 'embed_tokens.weight'" in message and "and 15 more" in message
    assert len(message) < 1000, len(message)
    # The fix works and equals transformers' own loading of the checkpoint.
    eager = transformers.LlamaForCausalLM.from_pretrained(causal)
    assert load_checkpoint(m, causal, prefix="model.") == LoadResult([], [])
    materialize_module(m)
    assert_same_tensors(eager.model, m)


def test_a_prefix_the_checkpoint_lacks_is_named_too(causal_lm_dir):
    _, base = causal_lm_dir
    m = deferred_init(transformers.LlamaForCausalLM, llama_config())
    with pytest.raises(CheckpointMismatchError, match=r"rename=lambda k: 'model.' \+ k") as info:
        load_checkpoint(m, base)
    assert len(str(info.value)) < 1000
    result = load_checkpoint(m, base, rename=lambda k: "model." + k, strict=False)
    assert result == LoadResult(["lm_head.weight"], [])
    eager = transformers.LlamaModel.from_pretrained(base)
    materialize_module(m)
    assert_same_tensors(eager, m.model)


def test_keys_without_a_common_prefix_get_no_hint(causal_lm_dir):
    causal, _ = causal_lm_dir
    m = deferred_init(lambda: torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(CheckpointMismatchError) as info:
        load_checkpoint(m, causal)
    assert "in front" not in str(info.value) and "strict=False" in str(info.value)


def test_a_prefix_that_matches_no_key_says_so_and_names_the_right_one(causal_lm_dir):
    causal, _ = causal_lm_dir
    m = deferred_init(transformers.LlamaModel, llama_config())
    with pytest.raises(CheckpointMismatchError) as info:
        load_checkpoint(m, causal, prefix="transformer.")
    message = str(info.value)
    assert "prefix='transformer.' matches none of the checkpoint's" in message
    assert "pass prefix='model.'" in message and len(message) < 1000
    m = deferred_init(lambda: torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(CheckpointMismatchError, match="matches none.*Its keys: 'lm_head.weight', 'model.embed_tokens.weight'"):
        load_checkpoint(m, causal, prefix="transformer.")
