"""Quantizing a deferred model with the real libraries equals eager construct-then-quantize
(issue 25, items 1 and 2).

torchao (``quantize_`` with int8 and int4 weight-only, int8 dynamic, float8
weight-only configs; float8 training conversion; NF4), bitsandbytes on its
CPU backend (``Linear8bitLt``/``Linear4bit`` and ``.to()``), torchtune's
QLoRA builders and transformers' ``from_pretrained`` with
``BitsAndBytesConfig``/``TorchAoConfig``: each flow runs eagerly and with
the model deferred (the quantization inside the block, or after it), and
every tensor is compared through its wrapper subclasses (classes, flatten
metadata, ``Parameter``-ness, ``requires_grad``, inner tensors bit for bit),
the tensors parameters carry (``SCB``, ``quant_state``), the forward pass
and what the default generator draws next.  A test skips, saying why, when
its library is not installed (``make test`` installs them: see the Makefile).
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch
import torch.nn as nn

from deferinit import deferred, is_deferred
from deferinit.materialize import materialize_module
from helpers import assert_same_wrapped


def _library(name):
    try:
        return importlib.import_module(name)
    except ImportError as e:  # pragma: no cover - depends on the environment
        pytest.skip(f"{name} is not installed ({e}); `make test` installs it", allow_module_level=False)


def _torchtune():
    """torchtune 0.6.1 imports NF4 from ``torchao.dtypes.nf4tensor``, which torchao
    0.18 moved to ``torchao.quantization``: the same module under its old name."""
    _library("torchao")
    if "torchao.dtypes.nf4tensor" not in sys.modules:
        try:
            importlib.import_module("torchao.dtypes.nf4tensor")
        except ImportError:
            sys.modules["torchao.dtypes.nf4tensor"] = importlib.import_module(
                "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"
            )
    return _library("torchtune")


def _compare(build, convert=None, where="inside", forward=None):
    """``convert(build())`` eagerly and deferred from seed 0 (``convert`` inside
    the block or after it), the deferred model materialized: same tensors, same
    forward, same generator afterwards.  Returns both models."""
    convert = convert or (lambda m: m)
    torch.manual_seed(0)
    eager = convert(build())
    eager_next = torch.rand(4)
    torch.manual_seed(0)
    with deferred():
        d = build()
        if where == "inside":
            d = convert(d)
    if where == "after":
        d = convert(d)
    assert is_deferred(d)
    materialize_module(d)
    d_next = torch.rand(4)
    assert_same_wrapped(eager, d)
    assert torch.equal(eager_next, d_next), "the generator after materialization differs from eager"
    if forward is not None:
        x = forward()
        assert torch.equal(eager(x), d(x))
    return eager, d


def _mlp():
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))


def _x():
    return torch.randn(3, 64)


# -- torchao -------------------------------------------------------------------


def _ao_configs():
    ao = importlib.import_module("torchao.quantization")
    return {
        "int8 weight-only": lambda: ao.Int8WeightOnlyConfig(set_inductor_config=False),
        "int4 weight-only": lambda: ao.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=ao.PerGroup(32)),
        "int8 dynamic": lambda: ao.Int8DynamicActivationInt8WeightConfig(set_inductor_config=False),
        "float8 weight-only": lambda: ao.Float8WeightOnlyConfig(set_inductor_config=False),
    }


AO_CONFIGS = ["int8 weight-only", "int4 weight-only", "int8 dynamic", "float8 weight-only"]


@pytest.mark.parametrize("where", ["inside", "after"])
@pytest.mark.parametrize("config", AO_CONFIGS)
def test_torchao_quantize_(config, where):
    """Inside the block nn.Parameter(quantized) raised; after it, materialize_module
    returned with the quantized weights still fake and is_deferred False."""
    _library("torchao")
    from torchao.quantization import quantize_

    make = _ao_configs()[config]
    eager, d = _compare(_mlp, lambda m: quantize_(m, make()) or m, where, forward=_x)
    assert type(d[0].weight) is type(eager[0].weight) and type(d[0].weight) is not nn.Parameter


def _int4_packing_formats():
    try:
        from torchao.quantization.quantize_.workflows.int4.int4_packing_format import Int4PackingFormat
    except ImportError:  # pragma: no cover - depends on the environment
        return []
    return [f.name for f in Int4PackingFormat]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA these formats quantize: this checks the CPU refusal")
@pytest.mark.parametrize("packing", _int4_packing_formats())
def test_torchao_int4_packing_formats_refuse_on_cpu_as_eagerly(packing):
    """Int4WeightOnlyConfig's packing formats need CUDA kernels (mslk, tinygemm)
    or XPU: on CPU, eager quantize_ raises, and deferred (inside or after the
    block) raises the same; after the block the model is left deferred and
    materializes equal to the eager unquantized one."""
    _library("torchao")
    from torchao.quantization import Int4WeightOnlyConfig, quantize_
    from torchao.quantization.quantize_.workflows.int4.int4_packing_format import Int4PackingFormat

    def build():
        return _mlp().to(torch.bfloat16)

    def convert(m):
        config = Int4WeightOnlyConfig(group_size=32, int4_packing_format=Int4PackingFormat[packing],
                                      set_inductor_config=False)
        quantize_(m, config)
        return m

    def failure(run):
        with pytest.raises(Exception) as info:
            run()
        return type(info.value), str(info.value).splitlines()[0]

    torch.manual_seed(0)
    eager = build()
    eager_failure = failure(lambda: convert(build()))

    def inside():
        with deferred():
            convert(build())

    assert failure(inside) == eager_failure
    torch.manual_seed(0)
    with deferred():
        d = build()
    assert failure(lambda: convert(d)) == eager_failure
    assert is_deferred(d)
    materialize_module(d)
    assert_same_wrapped(eager, d)


@pytest.mark.parametrize("where", ["inside", "after"])
@pytest.mark.parametrize("fsdp_all_gather", [False, True], ids=["plain weights", "float8 all-gather weights"])
def test_torchao_float8_training_conversion(where, fsdp_all_gather):
    _library("torchao")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_all_gather)
    eager, d = _compare(_mlp, lambda m: convert_to_float8_training(m, config=config), where)
    assert type(d[0]).__name__ == "Float8Linear"
    assert (type(d[0].weight) is not nn.Parameter) == fsdp_all_gather


def test_torchao_nf4_parameter():
    _library("torchao")
    from torchao.quantization import to_nf4

    def build():
        lin = nn.Linear(512, 256, bias=False)
        lin.weight = nn.Parameter(to_nf4(lin.weight), requires_grad=False)
        return lin

    eager, d = _compare(build)
    assert type(d.weight).__name__ == "NF4Tensor"


# -- torchtune -------------------------------------------------------------------


def _lora_kwargs(**extra):
    return dict(
        lora_attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True,
        apply_lora_to_output=False, lora_rank=8, lora_alpha=16, quantize_base=True, **extra,
    )


TUNE_BUILDERS = {
    "llama2": ("torchtune.models.llama2._component_builders", "lora_llama2", dict(
        vocab_size=128, num_layers=2, num_heads=4, num_kv_heads=4, embed_dim=256, max_seq_len=64,
        intermediate_dim=512)),
    "llama3": ("torchtune.models.llama3._component_builders", "lora_llama3", dict(
        vocab_size=128, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=256, max_seq_len=64,
        intermediate_dim=512)),
    "qwen2": ("torchtune.models.qwen2._component_builders", "lora_qwen2", dict(
        vocab_size=128, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=256, max_seq_len=64,
        intermediate_dim=512)),
    "mistral": ("torchtune.models.mistral._component_builders", "lora_mistral", dict(
        vocab_size=128, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=256, max_seq_len=64,
        intermediate_dim=512)),
}


@pytest.mark.parametrize("family", list(TUNE_BUILDERS))
def test_torchtune_qlora_builders(family):
    """Every torchtune QLoRA builder raised "detach() returns an instance of the
    same type" inside a deferral; here at small sizes, against eager."""
    _torchtune()
    module, name, sizes = TUNE_BUILDERS[family]
    builder = getattr(importlib.import_module(module), name)
    eager, d = _compare(lambda: builder(**_lora_kwargs(**sizes)), forward=lambda: torch.tensor([[1, 2, 3, 4]]))
    kinds = {type(p).__name__ for p in d.parameters()}
    assert "NF4Tensor" in kinds


@pytest.mark.slow
@pytest.mark.hunt  # about 10 CPU-minutes (2026-11-29: 38 min wall at load ~10 on 2 CPUs, passed)
@pytest.mark.timeout(3600)
def test_every_torchtune_qlora_builder_defers():
    """The full-size builders (7B to 70B), deferred: no memory, every base weight NF4
    (some ten minutes: each base weight's NF4 conversion is recorded op by op)."""
    tune = _torchtune()
    import pkgutil

    found = []
    for info in pkgutil.iter_modules(tune.models.__path__):
        try:
            package = importlib.import_module(f"torchtune.models.{info.name}")
        except ImportError:
            continue  # the vision models need torchvision
        found += [(n, getattr(package, n)) for n in dir(package) if n.startswith("qlora_")]
    assert len(found) >= 20
    for name, builder in found:
        with deferred():
            m = builder(lora_attn_modules=["q_proj", "v_proj"])
        assert is_deferred(m), name
        assert any(type(p).__name__ == "NF4Tensor" and is_deferred(p) for p in m.parameters()), name


# -- bitsandbytes ------------------------------------------------------------------


@pytest.mark.parametrize("where", ["inside", "after"])
@pytest.mark.parametrize("layer", ["Linear8bitLt", "Linear4bit nf4", "Linear4bit fp4 nested"])
def test_bitsandbytes_layers_moved_to_cpu(layer, where):
    """.to("cpu") inside the block gave float32 weights without SCB/quant_state:
    FakeTensor.to came before Int8Params.to/Params4bit.to."""
    bnb = _library("bitsandbytes")

    def build():
        if layer == "Linear8bitLt":
            return nn.Sequential(bnb.nn.Linear8bitLt(64, 32, has_fp16_weights=False), nn.ReLU())
        quant_type, nested = layer.split()[1], layer.endswith("nested")
        return nn.Sequential(bnb.nn.Linear4bit(64, 32, quant_type=quant_type, compress_statistics=nested), nn.ReLU())

    def to_cpu(m):
        m = m.to("cpu")
        # What .to() quantized: compared (with everything else) before the forward
        # pass, which moves Int8Params' SCB into the layer's state.
        w = m[0].weight
        assert w.dtype == (torch.int8 if layer == "Linear8bitLt" else torch.uint8)
        assert (w.SCB if layer == "Linear8bitLt" else w.quant_state.absmax) is not None
        return m

    _compare(build, to_cpu, where, forward=_x)


# -- transformers -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    torch.manual_seed(1)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def _quantization_config(kind):
    import transformers

    if kind == "bitsandbytes 8-bit":
        _library("bitsandbytes")
        return transformers.BitsAndBytesConfig(load_in_8bit=True)
    if kind == "bitsandbytes 4-bit":
        _library("bitsandbytes")
        return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    _library("torchao")
    from torchao.quantization import Int8WeightOnlyConfig

    return transformers.TorchAoConfig(Int8WeightOnlyConfig(set_inductor_config=False))


@pytest.mark.parametrize("kind", ["bitsandbytes 8-bit", "bitsandbytes 4-bit", "torchao int8"])
def test_transformers_from_pretrained_quantized_inside_the_block(tiny_llama, kind):
    """materialize_module returned with bitsandbytes' weights fake (is_deferred
    False, the forward on fakes); TorchAoConfig raised in nn.Parameter."""
    import transformers

    def load():
        return transformers.AutoModelForCausalLM.from_pretrained(
            tiny_llama, quantization_config=_quantization_config(kind), device_map="cpu"
        )

    eager, d = _compare(load)
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(eager(ids).logits, d(ids).logits)
    assert type(d.model.layers[0].mlp.up_proj.weight) is type(eager.model.layers[0].mlp.up_proj.weight)


def _hf_quantize(model, kind):
    """transformers' own quantization path on a built model, as ``from_pretrained``
    runs it while loading: the quantizer's ``preprocess_model`` (bitsandbytes:
    ``replace_with_bnb_linear``, whose layers are empty on ``meta``), each weight
    through the quantizer's quantize operation (bitsandbytes: ``Int8Params(w)`` /
    ``Params4bit(w)`` then ``.to()``; torchao: ``quantize_`` of the layer), then
    ``postprocess_model``; weights the quantizer leaves alone are put back."""
    from transformers.quantizers import AutoHfQuantizer

    quantizer = AutoHfQuantizer.from_config(_quantization_config(kind))
    quantizer.validate_environment(device_map={"": "cpu"})
    weights = dict(model.state_dict(keep_vars=True))
    quantizer.preprocess_model(model, device_map={"": "cpu"})
    op = quantizer.get_quantize_ops()
    for name, value in weights.items():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        if quantizer.param_needs_quantization(model, name):
            for key, new in op.convert({name: [value]}, model=model, full_layer_name=name, missing_keys=set()).items():
                holder, _, leaf = key.rpartition(".")
                model.get_submodule(holder)._parameters[leaf] = new
        elif attr in module._parameters and module._parameters[attr].is_meta:
            module._parameters[attr] = nn.Parameter(value.detach(), requires_grad=value.requires_grad)
    quantizer.postprocess_model(model)
    return model


@pytest.mark.parametrize("kind", ["bitsandbytes 8-bit", "bitsandbytes 4-bit", "torchao int8"])
def test_transformers_quantizer_after_the_block(kind):
    """A model built with from_config inside the block, quantized after it by
    transformers' own quantizer: bitsandbytes' Int8Params(deferred weight)
    raised PyTorch's "already associated to a python object of type FakeTensor"
    (torch.Tensor._make_subclass took fakes only inside a fake mode)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True,
    )
    eager, d = _compare(
        lambda: transformers.AutoModelForCausalLM.from_config(config), lambda m: _hf_quantize(m, kind), "after"
    )
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(eager(ids).logits, d(ids).logits)
    weight = d.model.layers[0].mlp.up_proj.weight
    assert type(weight) is type(eager.model.layers[0].mlp.up_proj.weight) and type(weight) is not nn.Parameter
    assert (d.lm_head.weight is d.model.embed_tokens.weight) == (eager.lm_head.weight is eager.model.embed_tokens.weight)
