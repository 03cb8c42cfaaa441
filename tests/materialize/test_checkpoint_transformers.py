"""Pretrained transformers models into deferred ones, two ways (issue 12):
``deferred_init(Model.from_pretrained, path)`` and ``deferred_init(Model, config)``
+ ``load_checkpoint(path)``; both against eager ``from_pretrained``.

Tiny models are saved locally with ``save_pretrained`` (one file, and
sharded with an index); nothing is downloaded.
"""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from deferinit import deferred_init, is_deferred  # noqa: E402
from helpers import assert_same_tensors  # noqa: E402
from deferinit.materialize import LoadResult, load_checkpoint, materialize_module  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    ),
    "llama-tied": lambda: transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    ),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64),
}
CLASSES = {"llama": "LlamaForCausalLM", "llama-tied": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}


@pytest.fixture(params=["single", "sharded"])
def saved(request, tmp_path):
    def save(name):
        cls = getattr(transformers, CLASSES[name])
        torch.manual_seed(42)
        model = cls(CONFIGS[name]())
        shard = "20KB" if request.param == "sharded" else "10GB"
        model.save_pretrained(tmp_path, max_shard_size=shard)
        if request.param == "sharded":
            assert os.path.exists(tmp_path / "model.safetensors.index.json")
        return cls, str(tmp_path)

    return save


@pytest.mark.parametrize("name", list(CONFIGS))
def test_deferred_from_pretrained_equals_eager_from_pretrained(name, saved):
    cls, path = saved(name)
    torch.manual_seed(0)
    eager = cls.from_pretrained(path)
    eager_next = torch.rand(8)
    torch.manual_seed(0)
    m = deferred_init(cls.from_pretrained, path)
    # transformers builds on the meta device and assigns the loaded tensors:
    # what stays deferred is what it computes itself (Llama's rotary buffer).
    assert is_deferred(m) == name.startswith("llama")
    materialize_module(m)
    assert_same_tensors(eager, m)
    assert torch.equal(torch.rand(8), eager_next)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_load_checkpoint_of_a_pretrained_directory_equals_eager_from_pretrained(name, saved):
    cls, path = saved(name)
    eager = cls.from_pretrained(path)
    torch.manual_seed(0)
    m = deferred_init(cls, cls.config_class.from_pretrained(path))
    result = load_checkpoint(m, path, strict=False)
    # Buffers transformers does not save (rotary inv_freq) are not persistent.
    assert result.unexpected_keys == [] and all("inv_freq" not in k for k in result.missing_keys)
    materialize_module(m)
    assert_same_tensors(eager, m)
    assert m.get_output_embeddings().weight is not None


def test_load_checkpoint_of_a_base_model_with_a_prefix(saved):
    cls, path = saved("llama")
    eager = cls.from_pretrained(path)
    m = deferred_init(transformers.LlamaModel, transformers.LlamaConfig.from_pretrained(path))
    assert load_checkpoint(m, path, prefix="model.") == LoadResult([], [])
    materialize_module(m)
    assert_same_tensors(eager.model, m)
