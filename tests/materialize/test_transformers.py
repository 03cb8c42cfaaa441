"""The everyday corpus: HuggingFace transformers architectures from small configs (issue 4).

No weights are downloaded: models are built from configs only.
"""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from deferinit import deferred_init, is_deferred  # noqa: E402
from helpers import check_exact  # noqa: E402
from deferinit.materialize import materialize_module  # noqa: E402

SMALL_LLAMA = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def corpus():
    t = transformers
    return {
        "llama": (t.LlamaForCausalLM, t.LlamaConfig(**SMALL_LLAMA, tie_word_embeddings=False)),
        "llama-tied": (t.LlamaForCausalLM, t.LlamaConfig(**SMALL_LLAMA, tie_word_embeddings=True)),
        "gpt2": (t.GPT2LMHeadModel, t.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64)),
        "bert": (
            t.BertModel,
            t.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, max_position_embeddings=64),
        ),
        "t5": (t.T5ForConditionalGeneration, t.T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)),
        "mixtral": (
            t.MixtralForCausalLM,
            t.MixtralConfig(**SMALL_LLAMA, num_local_experts=4, num_experts_per_tok=2),
        ),
        "vit": (
            t.ViTModel,
            t.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32, patch_size=8),
        ),
    }


CORPUS = corpus()


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("order", ["module", "reverse", 7])
@pytest.mark.parametrize("name", list(CORPUS))
def test_transformers_models(name, order):
    cls, config = CORPUS[name]
    eager, m = check_exact(cls, config, order=order)
    out_e, out_d = eager.get_output_embeddings(), m.get_output_embeddings()
    if out_e is not None:
        tied_e = out_e.weight is eager.get_input_embeddings().weight
        assert tied_e == (out_d.weight is m.get_input_embeddings().weight)


@pytest.mark.filterwarnings("ignore")
def test_llama_forward_backward_after_materialization():
    cls, config = CORPUS["llama"]
    torch.manual_seed(0)
    eager = cls(config)
    torch.manual_seed(0)
    m = deferred_init(cls, config)
    assert is_deferred(m)
    materialize_module(m)
    ids = torch.randint(0, 128, (2, 8))
    expected = eager(ids, labels=ids)
    got = m(ids, labels=ids)
    assert torch.equal(expected.logits, got.logits)
    got.loss.backward()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    opt.step()
    assert all(p.grad is not None for p in m.parameters() if p.requires_grad)
