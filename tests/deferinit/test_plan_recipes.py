"""Planning the steps people train (issue 20): each recipe equals the real step.

The reference is always the real step written in plain PyTorch on an eager
model, measured by PyTorch's own ``MemTracker`` / ``FSDPMemTracker`` (peak
and end of step, per device and category) and, in a separate run,
``FlopCounterMode``; the plan is ``deferinit.cli.recipe.plan_step`` on a
deferred model inside ``fake_mode``.  Recipes: activation checkpointing
(transformers' ``activation_checkpointing_enable``, PyTorch's composable
``checkpoint``), bf16 mixed precision with fp32 master weights
(``torch.autocast``; FSDP2's ``MixedPrecisionPolicy``), gradient
accumulation, the optimizer and its arguments; and transformers decoders
with ``use_cache=False``, whose masking code checks position ids made with
``torch.arange``.
"""

import contextlib

import re

import pytest
import torch

from deferinit import deferred_init
from deferinit.cli.fakedist import fake_ranks
from deferinit.cli.recipe import Recipe, plan_step
from deferinit.demo import LLAMA_TINY, Llama
from deferinit.fake import fake_mode

B, S = 2, 16


def hf_llama(**extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=500, max_position_embeddings=512, **extra))


def hf_mistral(**extra):
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=500,
                                            max_position_embeddings=512, sliding_window=8, **extra))


def hf_gpt2(**extra):
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=500, n_positions=512,
                                      bos_token_id=0, eos_token_id=0, **extra))


def demo_llama():
    return Llama(LLAMA_TINY)


def _vocab(make):
    return LLAMA_TINY.vocab_size if make is demo_llama else 500


def _inputs(make, seq=S):
    ids = torch.randint(0, _vocab(make), (B, seq))
    if make is demo_llama:
        return (ids,), {}, ids
    return (), {"input_ids": ids, "labels": ids}, ids


def _loss(make, out, ids):
    if make is demo_llama:
        return torch.nn.functional.cross_entropy(out.flatten(0, -2).float(), ids.flatten())
    return out.loss


def real_step(make, *, checkpointing=False, amp=None, accumulate=1, shard=None, optimizer=None, seq=S, config=None):
    """The step as a user writes it, on an eager model, under PyTorch's trackers:
    ``(peak, after)`` from MemTracker / FSDPMemTracker, and the FLOPs of the same
    step run again under FlopCounterMode alone."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.utils.flop_counter import FlopCounterMode

    results = []
    for measure in ("memory", "flops"):
        torch.manual_seed(0)
        with fake_ranks(shard, 0, "cpu") if shard else contextlib.nullcontext() as mesh:
            model = make(**(config or {}))
            model.train()
            if checkpointing:
                if hasattr(model, "activation_checkpointing_enable"):
                    model.activation_checkpointing_enable()  # transformers 5 (gradient_checkpointing_enable before)
                else:
                    from torch.distributed._composable import checkpoint

                    for block in model.layers:
                        checkpoint(block)
            if mesh is not None:
                policy = MixedPrecisionPolicy(param_dtype=amp, reduce_dtype=torch.float32) if amp else MixedPrecisionPolicy()
                layers = model.layers if make is demo_llama else (model.model.layers if hasattr(model, "model") else model.transformer.h)
                for block in layers:
                    fully_shard(block, mesh=mesh, mp_policy=policy)
                fully_shard(model, mesh=mesh, mp_policy=policy)
            opt = optimizer(model.parameters()) if optimizer else torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
            args, kwargs, ids = _inputs(make, seq)
            if measure == "memory":
                tracker = FSDPMemTracker(model, opt) if mesh is not None else MemTracker()
                if mesh is not None:
                    tracker.track_inputs(args + tuple(kwargs.values()))
                else:
                    tracker.track_external(model, opt)
            else:
                tracker = FlopCounterMode(display=False)
            with tracker:
                for micro in range(accumulate):
                    if micro and measure == "memory":
                        tracker.reset_mod_stats()
                    with torch.autocast("cpu", dtype=amp) if amp and mesh is None else contextlib.nullcontext():
                        loss = _loss(make, model(*args, **kwargs), ids)
                    if accumulate > 1:
                        loss = loss / accumulate  # as training loops write it (transformers' Trainer)
                    loss.backward()
                    del loss
                opt.step()
                opt.zero_grad()
                if measure == "memory":
                    after = tracker.get_tracker_snapshot()
            if measure == "memory":
                results += [_named(tracker.get_tracker_snapshot("peak")), _named(after)]
            else:
                results.append(tracker.get_total_flops())
    return tuple(results)


def _named(snapshot):
    return {device: {getattr(k, "name", k): v for k, v in cats.items()} for device, cats in snapshot.items()}


def planned_step(make, recipe, *, shard=None, seq=S, config=None):
    torch.manual_seed(0)
    with fake_ranks(shard, 0, "cpu") if shard else contextlib.nullcontext() as mesh:
        model = deferred_init(make, **(config or {}))
        with fake_mode():
            model.train()
            args, kwargs, ids = _inputs(make, seq)
            return plan_step(model, args, kwargs, recipe, mesh=mesh, token_ids=ids)


def _check(planned, real):
    peak, after, flops = real
    assert planned.peak == peak  # per device, per category, byte for byte
    assert planned.after == after
    assert planned.flops == flops > 0


@pytest.mark.parametrize("make", [hf_llama, hf_mistral, hf_gpt2], ids=lambda m: m.__name__)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["use_cache=False", "gradient checkpointing"])
def test_transformers_decoders_in_training_configs(make, checkpointing):
    """use_cache=False (and gradient checkpointing, which implies it) runs transformers'
    packed-sequence check on position ids from torch.arange: answered as eagerly."""
    config = {"use_cache": False}
    real = real_step(make, checkpointing=checkpointing, config=config)
    _check(planned_step(make, Recipe(checkpointing=checkpointing, foreach=False), config=config), real)


def test_position_checks_take_the_real_steps_path():
    """At 256 tokens transformers' mask path shows in the figures: the plan follows
    the real step's (no packed-sequence mask), as eager's answer to the check says."""
    config = {"use_cache": False}
    _check(planned_step(hf_llama, Recipe(foreach=False), seq=256, config=config),
           real_step(hf_llama, seq=256, config=config))


def test_tracing_questions_get_eagers_answers():
    """transformers asks whether it is traced (compile, jit, fx, PyTorch's FakeTensor):
    a fake of ours is none of those, so the code runs the path a real run takes."""
    from transformers.utils.import_utils import is_torchdynamo_compiling, is_tracing

    with fake_mode():
        ids = torch.arange(16).unsqueeze(0)
        assert not is_tracing(ids) and not is_torchdynamo_compiling()
        assert not torch.jit.is_tracing() and not torch.compiler.is_compiling()
        assert bool(((torch.diff(ids, dim=-1) != 1).cumsum(-1)[:, -1] == 0).all())


RECIPES = {
    "checkpointing": (dict(checkpointing=True), dict(checkpointing=True)),
    "bf16 mixed precision": (dict(mixed_precision=torch.bfloat16), dict(amp=torch.bfloat16)),
    "accumulation x3": (dict(accumulate=3), dict(accumulate=3)),
    "all three": (dict(checkpointing=True, mixed_precision=torch.bfloat16, accumulate=2),
                  dict(checkpointing=True, amp=torch.bfloat16, accumulate=2)),
}


@pytest.mark.parametrize("shard", [None, 2], ids=["unsharded", "FSDP2 x2"])
@pytest.mark.parametrize("make", [hf_llama, demo_llama], ids=lambda m: m.__name__)
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipes_equal_the_real_step(recipe, make, shard):
    ours, theirs = RECIPES[recipe]
    _check(planned_step(make, Recipe(foreach=False, **ours), shard=shard), real_step(make, shard=shard, **theirs))


@pytest.mark.parametrize("name, args, build", [
    ("adam", {"lr": 1e-3, "betas": (0.9, 0.95), "foreach": True},
     lambda p: torch.optim.Adam(p, lr=1e-3, betas=(0.9, 0.95), foreach=True)),
    ("SGD", {"foreach": False}, lambda p: torch.optim.SGD(p, lr=1e-4, momentum=0.9, foreach=False)),
    ("rmsprop", {"foreach": False, "momentum": 0.5}, lambda p: torch.optim.RMSprop(p, lr=1e-4, momentum=0.5, foreach=False)),
    ("torch.optim:NAdam", {"weight_decay": 0.1}, lambda p: torch.optim.NAdam(p, lr=1e-4, weight_decay=0.1, foreach=False)),
])
def test_the_optimizer_and_its_arguments(name, args, build):
    planned = planned_step(demo_llama, Recipe(optimizer=name, optimizer_args=args, foreach=False))
    assert type(planned.optimizer) is type(build([torch.nn.Parameter(torch.ones(1))]))
    _check(planned, real_step(demo_llama, optimizer=build))


def test_an_optimizer_that_reads_parameter_values_cannot_be_planned():
    """Adafactor scales its step by each parameter's norm, read with .item(): the values
    of a deferred model are unknown, and the error says what read it, where, and
    which optimizers plan instead (not "materialize the tensor first", which a
    planned step cannot do)."""
    from deferinit.fake import FakeDataAccessError

    with pytest.raises(FakeDataAccessError) as e:
        planned_step(demo_llama, Recipe(optimizer="adafactor", foreach=False))
    message = str(e.value)
    assert re.search(r"item\(\) needs the data of a fake tensor .*Adafactor\.step\(\) reads it as a Python number "
                     r"\(at torch/optim/_adafactor\.py:\d+\).*--optimizer adamw", message), message
    assert "materialize" not in message


def test_mixed_precision_keeps_fp32_masters_and_refuses_a_low_precision_build():
    planned = planned_step(demo_llama, Recipe(mixed_precision=torch.bfloat16))
    assert all(p.dtype == torch.float32 for p in planned.optimizer.param_groups[0]["params"])
    torch.manual_seed(0)
    model = deferred_init(Llama, LLAMA_TINY, dtype=torch.bfloat16)
    with fake_mode(), pytest.raises(ValueError, match="keeps float32 master weights.*bfloat16 parameters: build it in float32"):
        plan_step(model, (torch.zeros(1, 4, dtype=torch.long),), {}, Recipe(mixed_precision=torch.bfloat16))


class _Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("make, recipe, message", [
    (_Blocks, Recipe(optimizer="adamz", checkpointing=True), "no optimizer 'adamz' in torch.optim"),
    (_Blocks, Recipe(optimizer="torch.nn:Linear", checkpointing=True), "not a torch.optim.Optimizer subclass"),
    (_Blocks, Recipe(accumulate=0, checkpointing=True), "accumulate must be at least 1"),
    (_Blocks, Recipe(optimizer_args={"bettas": (0.9, 0.95)}, checkpointing=True),
     r"AdamW takes no argument 'bettas' \(it takes lr, betas, eps"),
    (lambda: torch.nn.Sequential(torch.nn.Linear(4, 4)), Recipe(checkpointing=True),
     "Sequential has no nn.ModuleList of blocks to checkpoint"),
])
def test_recipe_errors_name_the_fix(make, recipe, message):
    """Refused before the model is touched: no checkpointing hooks were added."""
    model = make()
    before = [(dict(m._forward_pre_hooks), dict(m._forward_hooks)) for m in model.modules()]
    with pytest.raises(ValueError, match=message):
        plan_step(model, (torch.randn(2, 4),), {}, recipe)
    assert [(dict(m._forward_pre_hooks), dict(m._forward_hooks)) for m in model.modules()] == before
