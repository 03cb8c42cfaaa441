"""``torch.compile`` beside deferred models (issue 20).

A compiled call of a model that is still deferred behaves as the plain call:
the documented ``DeferredModuleWarning`` naming the model, fake outputs of
the same shapes.  (Before, dynamo compiled the recorder's own code and died
with an ``AssertionError``.)  Compiling a materialized model gives what
compiling the eager one gives.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from deferinit import DeferredModuleWarning, deferred
from deferinit.fake import is_fake
from deferinit.materialize import materialize_module

transformers = pytest.importorskip("transformers")


def _calls(fn, *args):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = fn(*args)
    return out, [str(w.message) for w in seen if issubclass(w.category, DeferredModuleWarning)]


def _tiny_llama():
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1,
    )
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("how", ["torch.compile", "Module.compile", "compiled function"])
def test_compiling_a_deferred_model_runs_as_the_plain_call(how):
    torch._dynamo.reset()
    with deferred():
        m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.ones(3, 4)
    plain, plain_warnings = _calls(m, x)
    with deferred():
        m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    if how == "torch.compile":
        compiled = torch.compile(m)
    elif how == "Module.compile":
        m.compile()
        compiled = m
    else:
        compiled = torch.compile(lambda t: m(t))
    out, seen = _calls(compiled, x)
    assert is_fake(out) and out.shape == plain.shape and out.requires_grad == plain.requires_grad
    assert seen == plain_warnings and "Sequential is still deferred" in seen[0]
    out.sum().backward()  # backward through the fakes, as after the plain call
    assert is_fake(m[0].weight.grad)


def test_compiling_a_deferred_transformers_model():
    torch._dynamo.reset()
    with deferred():
        m = _tiny_llama()
    ids = torch.arange(5).unsqueeze(0)
    out, seen = _calls(torch.compile(m), ids)
    assert is_fake(out.logits) and out.logits.shape == (1, 5, 64)
    assert seen and "LlamaForCausalLM is still deferred" in seen[0]


def test_compile_of_the_materialized_model_equals_compile_of_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = _tiny_llama()
    torch.manual_seed(0)
    with deferred():
        m = _tiny_llama()
    torch.compile(m)  # compiled while deferred, run once materialized
    materialize_module(m)
    ids = torch.arange(5).unsqueeze(0)
    a = torch.compile(m)(ids).logits
    b = torch.compile(eager)(ids).logits
    assert torch.equal(a, b)


def test_fullgraph_refuses_a_deferred_model():
    """With ``fullgraph=True`` dynamo refuses the graph break a fake makes; its
    message names the fakes (docs/libraries.md: materialize first)."""
    torch._dynamo.reset()
    with deferred():
        m = nn.Linear(4, 4)
    with pytest.raises(Exception, match="FakeTensor"):
        torch.compile(m, fullgraph=True)(torch.ones(2, 4))
