"""Lightning Fabric's ``init_module`` and litgpt's pretraining idiom around a deferral.

``fabric.init_module(empty_init=True)`` enters torch-function modes
(``_EmptyInit`` skips ``nn.init``, ``torch.device`` sets the device);
litgpt's ``pretrain.py`` builds ``GPT(config)`` under it and then runs its
own initialization (``initialize_weights``).  Each flow runs eagerly and
with ``with deferred():`` from the same seed, the real libraries on both
sides: every parameter and buffer, the ties, and what the default generator
draws next must be eager's.
"""

from __future__ import annotations

import pytest
import torch

from deferinit import deferred, is_deferred
from deferinit.materialize import materialize_module

from helpers import assert_same_tensors

L = pytest.importorskip("lightning", reason="lightning is not installed (make test installs it)")
litgpt_model = pytest.importorskip("litgpt.model", reason="litgpt is not installed (make test installs it)")
litgpt_pretrain = pytest.importorskip("litgpt.pretrain", reason="litgpt is not installed (make test installs it)")

GPT, Config = litgpt_model.GPT, litgpt_model.Config

CONFIGS = {
    "pythia-14m": lambda: Config.from_name("pythia-14m"),
    # another family: RMSNorm, grouped queries, an MLP of another class
    "llama-shaped": lambda: Config.from_name(
        "Llama-3.2-1B", n_layer=2, n_embd=64, n_head=4, n_query_groups=2,
        intermediate_size=128, padded_vocab_size=256, vocab_size=256, block_size=64,
    ),
}


def _pretrain_flow(config, fabric, where, empty_init=True):
    """litgpt/pretrain.py's model set-up: GPT under init_module, then its init.
    ``where``: None (eager), "inside" (deferred() inside init_module) or
    "outside" (init_module inside deferred())."""
    torch.manual_seed(0)
    if where is None:
        with fabric.init_module(empty_init=empty_init):
            model = GPT(config)
    elif where == "inside":
        with fabric.init_module(empty_init=empty_init):
            with deferred():
                model = GPT(config)
    else:
        with deferred():
            with fabric.init_module(empty_init=empty_init):
                model = GPT(config)
    litgpt_pretrain.initialize_weights(fabric, model, n_layer=config.n_layer, n_embd=config.n_embd)
    if where is not None:
        assert is_deferred(model)
        materialize_module(model)
        assert not is_deferred(model)
    return model, torch.rand(8)


@pytest.mark.parametrize("where", ["inside", "outside"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_litgpt_pretraining_idiom_under_fabric_init_module_equals_eager(name, where):
    fabric = L.Fabric(accelerator="cpu", devices=1)
    config = CONFIGS[name]()
    eager, after_eager = _pretrain_flow(config, fabric, None)
    model, after = _pretrain_flow(config, fabric, where)
    assert_same_tensors(eager, model)
    assert torch.equal(after, after_eager), "the generator is not where eager leaves it"
    tokens = torch.randint(0, config.padded_vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
    assert torch.equal(model(tokens), eager(tokens))


def test_fabric_init_module_without_empty_init_keeps_the_models_own_init():
    fabric = L.Fabric(accelerator="cpu", devices=1)
    config = CONFIGS["pythia-14m"]()

    def flow(defer):
        torch.manual_seed(0)
        with fabric.init_module(empty_init=False):
            if defer:
                with deferred():
                    model = GPT(config)
            else:
                model = GPT(config)
        if defer:
            materialize_module(model)
        return model, torch.rand(8)

    eager, after_eager = flow(False)
    model, after = flow(True)
    assert_same_tensors(eager, model)
    assert torch.equal(after, after_eager)


def test_fabric_bf16_true_precision_builds_bf16_as_eagerly():
    """precision="bf16-true": init_module also sets the default dtype."""
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="bf16-true")
    config = CONFIGS["llama-shaped"]()
    eager, after_eager = _pretrain_flow(config, fabric, None)
    model, after = _pretrain_flow(config, fabric, "inside")
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert_same_tensors(eager, model)
    assert torch.equal(after, after_eager)
