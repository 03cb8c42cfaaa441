"""PEFT's LoRA on deferred transformers models (issue 20), against the same flows run eagerly.

Inside ``deferred()`` everything PEFT does is recorded: values, ties and the
generator afterwards equal eager's.  After the block, PiSSA and OLoRA set
``.data`` of real LoRA weights to tensors computed from the deferred base
(this used to kill the process); the values equal eager, and the real
draws PEFT made for the LoRA layers first say they cannot be eager's
(``PendingDrawsWarning``).  Nothing is downloaded: tiny configs saved to a
temporary directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from deferinit import PendingDrawsWarning, deferred, is_deferred
from helpers import assert_same_tensors
from deferinit.materialize import materialize_module

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


def _base():
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1,
    )
    return transformers.LlamaForCausalLM(config)


def _lora(init):
    return peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=init)


@pytest.mark.parametrize("init", [True, False, "gaussian", "pissa", "olora"])
def test_lora_inside_deferred_equals_eager(init):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch.manual_seed(0)
        eager = peft.get_peft_model(_base(), _lora(init))
        eager_next = torch.rand(8)
        torch.manual_seed(0)
        with deferred():
            d = peft.get_peft_model(_base(), _lora(init))
        assert is_deferred(d)
        materialize_module(d)
    assert_same_tensors(eager, d)
    assert torch.equal(torch.rand(8), eager_next)


def test_lora_after_the_block_warns_that_its_draws_are_not_eagers():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch.manual_seed(0)
        eager = peft.get_peft_model(_base(), _lora(True))
        torch.manual_seed(0)
        with deferred():
            base = _base()
        with pytest.warns(PendingDrawsWarning, match="constructing .*Linear.* deferred\\(\\) at test_peft.py"):
            d = peft.get_peft_model(base, _lora(True))
        materialize_module(d)
    a, b = eager.state_dict(), d.state_dict()
    differ = sorted(k for k in a if not torch.equal(a[k], b[k]))
    assert differ and all("lora_A" in k for k in differ)  # the base model is eager's


def test_pissa_and_olora_after_the_block_equal_eager_in_a_subprocess():
    """The LoRA weights are real, the base deferred: ``lora_A.weight.data = Vr``."""
    code = """
import warnings, torch, peft, transformers
from deferinit import PendingDrawsWarning, deferred
from deferinit.materialize import materialize_module
warnings.simplefilter("ignore", FutureWarning)
config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
for init in ("pissa", "olora"):
    lora = lambda: peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=init)
    torch.manual_seed(0)
    eager = peft.get_peft_model(transformers.LlamaForCausalLM(config), lora())
    torch.manual_seed(0)
    with deferred():
        base = transformers.LlamaForCausalLM(config)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        d = peft.get_peft_model(base, lora())
    assert any(issubclass(w.category, PendingDrawsWarning) for w in seen)
    materialize_module(d)
    a, b = eager.state_dict(), d.state_dict()
    assert a.keys() == b.keys()
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, (init, bad)
    ids = torch.arange(6).unsqueeze(0)
    assert torch.equal(eager(ids).logits, d(ids).logits)
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert r.returncode == 0 and "ok" in r.stdout, f"exit status {r.returncode}\n{r.stderr[-3000:]}"


def test_peft_model_from_pretrained_inside_deferred_equals_eager(tmp_path):
    """Base weights and adapter both read from safetensors files inside the block."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch.manual_seed(0)
        base = _base()
        base.save_pretrained(tmp_path / "base")
        peft.get_peft_model(base, _lora("gaussian")).save_pretrained(tmp_path / "adapter")

        def build():
            b = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base")
            return peft.PeftModel.from_pretrained(b, tmp_path / "adapter")

        torch.manual_seed(5)
        eager = build()
        eager_next = torch.rand(8)
        torch.manual_seed(5)
        with deferred():
            d = build()
        materialize_module(d)
    assert_same_tensors(eager, d)
    assert torch.equal(torch.rand(8), eager_next)
    ids = torch.arange(6).unsqueeze(0)
    assert torch.equal(eager(ids).logits, d(ids).logits)
