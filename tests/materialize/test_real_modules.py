"""Constructors that re-initialize real modules passed to them (issue 19, item 1).

The transformers/timm pattern: a module built eagerly is passed to a
constructor whose ``self.apply(self._init_weights)`` (transformers'
``post_init``) re-initializes every submodule, the real one included.
Eagerly those draws continue the generator where the draws before them
left it.  Under ``deferred_init`` the real module must get exactly eager's
values (at once: it is real), the deferred modules drawn after it must
continue from there, and the generator must end where eager construction
leaves it, in any order of materialization.  Eager PyTorch is the reference.
"""

import os

import pytest
import torch
import torch.nn as nn

from deferinit import deferred_init, is_deferred
from deferinit.fake import FakeIntoRealError
from helpers import assert_same_tensors, materialize_in_order, named_tensors
from deferinit.materialize import materialize_module

ORDERS = ["module", "forward", "reverse", 7]


def _materialize(model, order):
    if order == "module":
        materialize_module(model)
    else:
        materialize_in_order(model, order)
        materialize_module(model)  # anything left (nothing, normally)


class Reinit(nn.Module):
    """Deferred layers around a real backbone; _init_weights over everything."""

    def __init__(self, backbone, generator=None):
        super().__init__()
        self.pre = nn.Linear(6, 6)
        self.backbone = backbone
        self.head = nn.Linear(6, 3)
        self.generator = generator
        self.apply(self._init_weights)
        self.tail = nn.Linear(3, 2)  # drawn after the real draws

    def _init_weights(self, m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02, generator=self.generator)
            if m.bias is not None:
                nn.init.trunc_normal_(m.bias, std=0.5, generator=self.generator)
        elif isinstance(m, nn.Embedding):
            m.weight.data.uniform_(-1, 1)
        elif isinstance(m, nn.LayerNorm):
            m.weight.data.fill_(1.0)


def _backbone():
    return nn.Sequential(nn.Embedding(5, 6), nn.Linear(6, 6), nn.LayerNorm(6), nn.Linear(6, 6))


def _build(make_generator=None):
    """``(real backbone, constructor args)`` as a program builds them, seeded."""
    torch.manual_seed(0)
    backbone = _backbone()
    generator = make_generator() if make_generator else None
    return backbone, generator


@pytest.mark.parametrize("order", ORDERS, ids=str)
@pytest.mark.parametrize("explicit", [False, True], ids=["default generator", "explicit generator"])
def test_real_module_reinitialized_inside_a_deferral(order, explicit):
    make = (lambda: torch.Generator().manual_seed(11)) if explicit else None
    backbone, g = _build(make)
    eager = Reinit(backbone, g)
    eager_next = torch.rand(8)
    eager_g_next = torch.rand(8, generator=g) if explicit else None

    backbone, g = _build(make)
    d = deferred_init(Reinit, backbone, g)
    # The real backbone holds eager's values at once, and stays real.
    for name, t in named_tensors(backbone).items():
        assert not is_deferred(t), name
        assert torch.equal(t, named_tensors(eager.backbone)[name]), f"backbone.{name} differs from eager"
    assert is_deferred(d.head.weight) and is_deferred(d.tail.weight)
    _materialize(d, order)
    assert_same_tensors(eager, d)
    if order == "module":  # tensor by tensor, the last draw may come first
        assert torch.equal(torch.rand(8), eager_next), "the generator is not where eager construction leaves it"
    if explicit:
        assert torch.equal(torch.rand(8, generator=g), eager_g_next), "the explicit generator is not eager's"


def test_generator_after_every_tensor_materialized_in_reverse():
    backbone, _ = _build()
    eager = Reinit(backbone)
    eager_next = torch.rand(8)
    backbone, _ = _build()
    d = deferred_init(Reinit, backbone)
    materialize_in_order(d, "reverse")
    assert_same_tensors(eager, d)
    assert torch.equal(torch.rand(8), eager_next)


class ReadsStateAfterRealDraw(nn.Module):
    """A real draw, then the state read through torch's API and a seed set."""

    def __init__(self, real):
        super().__init__()
        self.a = nn.Linear(4, 4)
        nn.init.normal_(real)
        self.register_buffer("state", torch.get_rng_state())
        self.b = nn.Linear(4, 4)
        torch.manual_seed(3)
        real.bernoulli_(0.5)
        self.c = nn.Linear(4, 4)


def test_state_read_and_seed_around_real_draws():
    torch.manual_seed(0)
    real = torch.empty(5, 5)
    eager = ReadsStateAfterRealDraw(real)
    eager_real, eager_next = real.clone(), torch.rand(8)
    torch.manual_seed(0)
    real = torch.empty(5, 5)
    d = deferred_init(ReadsStateAfterRealDraw, real)
    assert torch.equal(real, eager_real)
    materialize_module(d)
    assert_same_tensors(eager, d)
    assert torch.equal(torch.rand(8), eager_next)


def test_real_draw_from_deferred_probabilities_is_still_refused():
    """A random op writing a real tensor from deferred values is refused by name,
    as any write of deferred data into a real tensor (the real one unchanged)."""
    real = torch.zeros(3)

    def build():
        p = torch.full((3,), 0.5)
        real.bernoulli_(p)
        return p

    with pytest.raises(FakeIntoRealError, match="bernoulli_"):
        deferred_init(build)
    assert torch.equal(real, torch.zeros(3))


# -- transformers: Perceiver builds its pre-processor and decoder outside --------------


def _perceiver_parts(cfg):
    from transformers.models.perceiver.modeling_perceiver import (
        PerceiverClassificationDecoder, PerceiverTextPreprocessor,
    )

    return {
        "input_preprocessor": PerceiverTextPreprocessor(cfg),
        "decoder": PerceiverClassificationDecoder(
            cfg, num_channels=cfg.d_latents,
            trainable_position_encoding_kwargs={"num_channels": cfg.d_latents, "index_dims": 1},
            use_query_residual=True,
        ),
    }


@pytest.mark.parametrize("order", ORDERS, ids=str)
def test_transformers_perceiver_with_real_decoder_and_preprocessor(order):
    """PerceiverModel(config, input_preprocessor=..., decoder=...) with the two
    built eagerly (as PerceiverForSequenceClassification builds them, here
    outside the deferral): its post_init re-initializes them."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    from transformers.models.perceiver.modeling_perceiver import PerceiverModel

    transformers.logging.set_verbosity_error()
    cfg = transformers.PerceiverConfig(
        num_latents=4, d_latents=8, d_model=8, num_blocks=1, num_self_attends_per_block=1,
        num_self_attention_heads=2, num_cross_attention_heads=2, vocab_size=20,
        max_position_embeddings=16, num_labels=3,
    )
    torch.manual_seed(0)
    eager = PerceiverModel(cfg, **_perceiver_parts(cfg))
    eager_next = torch.rand(8)
    torch.manual_seed(0)
    parts = _perceiver_parts(cfg)
    d = deferred_init(PerceiverModel, cfg, **parts)
    for name, t in parts["decoder"].state_dict().items():
        assert torch.equal(t, eager.decoder.state_dict()[name]), f"decoder.{name} differs from eager"
    _materialize(d, order)
    assert_same_tensors(eager, d)
    if order == "module":
        assert torch.equal(torch.rand(8), eager_next), "the generator is not where eager construction leaves it"



# -- every in-place random fill of a real tensor ----------------------------------------

_PROBABILITIES = torch.full((6, 5), 0.25)
REAL_FILLS = {
    "normal_": lambda t: t.normal_(2.0, 3.0),
    "uniform_": lambda t: t.uniform_(-2, 2),
    "bernoulli_(p)": lambda t: t.bernoulli_(0.3),
    "bernoulli_(tensor)": lambda t: t.bernoulli_(_PROBABILITIES),
    "random_": lambda t: t.random_(0, 10),
    "exponential_": lambda t: t.exponential_(),
    "geometric_": lambda t: t.geometric_(0.3),
    "cauchy_": lambda t: t.cauchy_(),
    "log_normal_": lambda t: t.log_normal_(),
    "nn.init.kaiming_uniform_": lambda t: nn.init.kaiming_uniform_(t),
    "nn.init.trunc_normal_": lambda t: nn.init.trunc_normal_(t, std=0.5),
}


class FillsReal(nn.Module):
    def __init__(self, real, fill):
        super().__init__()
        self.a = nn.Linear(3, 3)
        with torch.no_grad():
            REAL_FILLS[fill](real)
        self.b = nn.Linear(3, 3)


@pytest.mark.parametrize("fill", list(REAL_FILLS))
def test_random_fill_of_a_real_tensor(fill):
    torch.manual_seed(0)
    real = torch.zeros(6, 5)
    eager = FillsReal(real, fill)
    eager_real, eager_version, eager_next = real.clone(), real._version, torch.rand(8)
    torch.manual_seed(0)
    real = torch.zeros(6, 5)
    d = deferred_init(FillsReal, real, fill)
    assert torch.equal(real, eager_real), "the real tensor differs from eager's"
    assert real._version == eager_version
    materialize_module(d)
    assert_same_tensors(eager, d)
    assert torch.equal(torch.rand(8), eager_next)


class RealDrawsAfterReseeds(nn.Module):
    """Real draws right after seeds set through every route, and a real draw
    eager refuses (it draws nothing)."""

    def __init__(self, real, g):
        super().__init__()
        self.a = nn.Linear(3, 3)
        g.manual_seed(5)                 # an explicit generator seeded by user code
        real[0].normal_(generator=g)
        self.b = nn.Parameter(torch.randn(4, generator=g))
        _REAL_GENERATOR.manual_seed(7)   # the real default generator, by a kept reference
        real[1].uniform_()
        try:
            real[2].bernoulli_(1.5)
        except RuntimeError:
            pass
        self.c = nn.Linear(3, 3)


_REAL_GENERATOR = torch.default_generator


def test_real_draws_after_reseeds_and_a_refused_one():
    torch.manual_seed(0)
    real, g = torch.zeros(3, 4), torch.Generator()
    eager = RealDrawsAfterReseeds(real, g)
    eager_real, eager_next, eager_g_next = real.clone(), torch.rand(8), torch.rand(8, generator=g)
    torch.manual_seed(0)
    real, g = torch.zeros(3, 4), torch.Generator()
    d = deferred_init(RealDrawsAfterReseeds, real, g)
    assert torch.equal(real, eager_real)
    materialize_module(d)
    assert_same_tensors(eager, d)
    assert torch.equal(torch.rand(8), eager_next)
    assert torch.equal(torch.rand(8, generator=g), eager_g_next)


class RealBetweenCuda(nn.Module):
    def __init__(self, backbone, device):
        super().__init__()
        self.pre = nn.Linear(4, 4, device=device)
        self.backbone = backbone
        nn.init.normal_(backbone.weight)
        self.head = nn.Linear(4, 4, device=device)


def test_recorded_for_cuda_materialized_on_cpu_around_a_real_cpu_draw():
    """A record for (fake) CUDA around a real CPU module, materialized on CPU:
    the deferred tensors and the generator are eager CPU construction's (the
    real draw is replayed into scratch for the state it leaves there); the
    real module keeps what it drew at recording, from the recorded devices'
    generators (the documented limit)."""
    torch.manual_seed(0)
    backbone = nn.Linear(4, 4)
    eager = RealBetweenCuda(backbone, "cpu")
    eager_next = torch.rand(8)
    torch.manual_seed(0)
    backbone = nn.Linear(4, 4)
    # Eagerly with the other layers on a device whose draws do not touch the
    # CPU generator (meta): what the CPU generator gives the real module then.
    drawn_at_recording = RealBetweenCuda(backbone, "meta").backbone.weight.clone()
    torch.manual_seed(0)
    backbone = nn.Linear(4, 4)
    d = deferred_init(RealBetweenCuda, backbone, "cuda")
    assert torch.equal(backbone.weight, drawn_at_recording)
    materialize_module(d, device="cpu")
    for name in ("pre.weight", "pre.bias", "head.weight", "head.bias"):
        assert torch.equal(named_tensors(d)[name], named_tensors(eager)[name]), f"{name} differs from eager on cpu"
    assert torch.equal(torch.rand(8), eager_next)
