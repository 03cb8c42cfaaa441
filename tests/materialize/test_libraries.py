"""Deferred models beside the libraries users run (issue 20): accelerate, diffusers,
quantization-style parameter classes, torchtitan.

Each flow runs eagerly and inside ``deferred()`` from the same seed; the
reference is the eager flow of the real library: every parameter and buffer
(class, device, dtype, ``requires_grad``, values where there are values),
the ties, and what the default generator draws next.  Nothing is
downloaded: tiny configs, saved to a temporary directory.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from deferinit import deferred, is_deferred
from deferinit.fake import is_fake
from helpers import assert_same_tensors, named_tensors
from deferinit.materialize import materialize_module


def _same_structure(eager: nn.Module, other: nn.Module) -> None:
    """What meta tensors allow comparing: everything but the values."""
    a, b = named_tensors(eager), named_tensors(other)
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        assert type(x) is type(y) and x.device == y.device and x.dtype == y.dtype, name
        assert x.shape == y.shape and x.requires_grad == y.requires_grad, name
        if not x.is_meta:
            assert torch.equal(x, y), name


def _eager_and_deferred(build, seed=0):
    torch.manual_seed(seed)
    eager = build()
    eager_next = torch.rand(8)
    torch.manual_seed(seed)
    with deferred():
        d = build()
    return eager, eager_next, d


# -- accelerate ------------------------------------------------------------------------------

accelerate = pytest.importorskip("accelerate")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 2)


@pytest.mark.parametrize("include_buffers", [False, True])
@pytest.mark.parametrize("nesting", ["inside deferred", "around deferred"])
def test_init_empty_weights_with_deferred_equals_init_empty_weights(nesting, include_buffers):
    """``type(p)(p.to(meta), **p.__dict__)``, accelerate's re-creation of each
    parameter, works on fakes: meta parameters as eagerly, real buffers
    deferred (unless ``include_buffers``)."""

    def empty():
        return accelerate.init_empty_weights(include_buffers=include_buffers)

    torch.manual_seed(0)
    with empty():
        eager = Net()
    eager_next = torch.rand(8)
    torch.manual_seed(0)
    if nesting == "inside deferred":
        with deferred(), empty():
            d = Net()
    else:
        with empty(), deferred():
            d = Net()
    assert not any(is_fake(p) for p in d.parameters())
    assert is_deferred(d) != include_buffers  # BatchNorm's statistics, made on CPU
    materialize_module(d)
    _same_structure(eager, d)
    assert torch.equal(torch.rand(8), eager_next)


def test_load_checkpoint_and_dispatch_into_an_empty_deferred_model(tmp_path):
    torch.manual_seed(1)
    source = Net()
    torch.save(source.state_dict(), tmp_path / "net.bin")
    with accelerate.init_empty_weights(), deferred():
        d = Net()
    d = accelerate.load_checkpoint_and_dispatch(d, str(tmp_path / "net.bin"), device_map={"": "cpu"})
    materialize_module(d)
    assert_same_tensors(source, d)


class QuantParams(nn.Parameter):
    """The shape of bitsandbytes' ``Int8Params``: a ``__new__`` of its own and
    attributes that ``type(p)(data, **p.__dict__)`` passes back in."""

    def __new__(cls, data=None, requires_grad=True, has_fp16_weights=False, scale=None):
        obj = torch.Tensor._make_subclass(cls, data, requires_grad)
        obj.has_fp16_weights = has_fp16_weights
        obj.scale = scale
        return obj


class Quantized(nn.Module):
    def __init__(self):
        super().__init__()
        w = torch.randn(4, 3)
        self.weight = QuantParams(w, requires_grad=False, scale=torch.tensor(2.0))
        moved = self.weight.to(torch.float64)
        self.weight = type(self.weight)(moved, **self.weight.__dict__)  # the re-creation idiom


def test_quantization_style_recreation_equals_eager():
    eager, eager_next, d = _eager_and_deferred(Quantized)
    assert is_deferred(d.weight) and isinstance(d.weight, QuantParams)
    materialize_module(d)
    assert type(d.weight) is QuantParams and d.weight.dtype == torch.float64
    assert torch.equal(d.weight, eager.weight) and d.weight.requires_grad == eager.weight.requires_grad
    assert d.weight.has_fp16_weights is False and torch.equal(d.weight.scale, eager.weight.scale)
    assert torch.equal(torch.rand(8), eager_next)


# -- transformers ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("llama")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
    )
    torch.manual_seed(4)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("route", ["from_pretrained", "from_pretrained, new head", "from_config"])
def test_transformers_inside_deferred_equals_eager(llama_dir, route):
    """Values, ties (tied embeddings) and the generator after: a checkpoint read
    inside the block, a head the checkpoint lacks initialised at random, or
    everything at random."""
    import transformers

    def build():
        if route == "from_pretrained":
            return transformers.LlamaForCausalLM.from_pretrained(llama_dir)
        if route == "from_pretrained, new head":
            return transformers.LlamaForSequenceClassification.from_pretrained(llama_dir, num_labels=3)
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(llama_dir))

    eager, eager_next, d = _eager_and_deferred(build)
    materialize_module(d)
    assert_same_tensors(eager, d)
    assert torch.equal(torch.rand(8), eager_next)


# -- diffusers -------------------------------------------------------------------------------

UNET = dict(
    sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(8, 16),
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=8, attention_head_dim=2, norm_num_groups=4,
)


@pytest.fixture(scope="module")
def unet_dir(tmp_path_factory):
    diffusers = pytest.importorskip("diffusers")
    path = tmp_path_factory.mktemp("unet")
    torch.manual_seed(3)
    diffusers.UNet2DConditionModel(**UNET).save_pretrained(path)
    return path


@pytest.mark.parametrize("route", ["from_pretrained", "from_config"])
def test_diffusers_unet_inside_deferred_equals_eager(unet_dir, route):
    """``from_pretrained`` builds under accelerate's ``init_empty_weights`` and reads
    safetensors; ``from_config`` initialises at random."""
    from diffusers import UNet2DConditionModel

    def build():
        if route == "from_pretrained":
            return UNet2DConditionModel.from_pretrained(unet_dir)
        return UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(unet_dir))

    eager, eager_next, d = _eager_and_deferred(build)
    assert is_deferred(d) == (route == "from_config")
    materialize_module(d)
    assert_same_tensors(eager, d)
    assert torch.equal(torch.rand(8), eager_next)
    sample, t, text = torch.randn(1, 4, 8, 8), torch.tensor([3]), torch.randn(1, 2, 8)
    assert torch.equal(eager(sample, t, text).sample, d(sample, t, text).sample)


# -- torchtitan ------------------------------------------------------------------------------


def _titan_config():
    try:
        from torchtitan.models.llama3 import llama3_configs
    except Exception as e:  # noqa: BLE001 - any import failure means: not installed here
        pytest.skip(f"torchtitan cannot be imported here ({type(e).__name__}: {e})")
    return llama3_configs["debugmodel"](attn_backend="flex")


def _titan_build(config):
    model = config.build()
    with torch.no_grad():
        model.init_states(buffer_device=None)
    return model


def test_torchtitan_llama3_deferred_equals_eager_and_its_meta_idiom_does_not():
    """torchtitan builds, then ``init_states()``; deferred and materialized this
    equals eager.  torchtitan's own idiom (build on meta, ``to_empty``,
    ``init_states``) skips the constructors' draws, so its values differ."""
    config = _titan_config()
    eager, eager_next, d = _eager_and_deferred(lambda: _titan_build(config))
    materialize_module(d)
    assert_same_tensors(eager, d)
    assert torch.equal(torch.rand(8), eager_next)

    torch.manual_seed(0)
    with torch.device("meta"):
        meta = config.build()
    meta.to_empty(device="cpu")
    with torch.no_grad():
        meta.init_states(buffer_device=None)
    differ = [n for n, t in named_tensors(eager).items() if not torch.equal(t, named_tensors(meta)[n])]
    assert differ, "torchtitan's meta idiom was expected to differ from eager"
