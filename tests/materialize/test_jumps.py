"""Replay jumps over earlier draws and draws only the parts a shard keeps (issue 29).

Against eager construction: a part materialized alone equals eager's part,
and the generator ends where eager's does; the kernels that run (seen by
torch.profiler with their shapes) are the part's own.  On the corpora's
models, the draws generated instead of jumped over (their word counts not
known) are counted by name, and docs/materialize.md lists them.
"""

from __future__ import annotations

import math
import os
import re
import sys

import pytest
import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

from deferinit import deferred_init
from deferinit.random.jumps import FALLBACKS
from deferinit.materialize import materialize_module, materialize_tensor
from helpers import assert_same_tensors, check_jump_models, materialize_in_order

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # the corpora of test_exact and test_transformers
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def random_kernels(fn) -> list:
    """``(kernel name, first input's shape)`` of the random kernels ``fn`` runs."""
    check_jump_models()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    names = ("aten::uniform_", "aten::normal_", "aten::random_", "aten::bernoulli_")
    return [(e.name, tuple(e.input_shapes[0]) if e.input_shapes else ()) for e in prof.events() if e.name in names]


class Sharded(nn.Module):
    """A parameter drawn whole, of which only rows [a, b) are kept (as an FSDP rank keeps its shard)."""

    def __init__(self, kernel, dtype, rows, cols, a, b):
        super().__init__()
        self.before = nn.Linear(16, 16)
        full = torch.empty(rows, cols, dtype=dtype)
        if kernel == "normal_":
            full.normal_(0.0, 0.02)
        else:
            nn.init.uniform_(full, -0.1, 0.1)
        self.shard = nn.Parameter(full[a:b].clone())
        self.after = nn.Parameter(torch.randn(5))


CASES = [
    ("normal_", torch.float32, 40, 7, 10, 20),   # 280 elements: blocks of 16, a tail of 8
    ("normal_", torch.float32, 40, 7, 36, 40),   # the rows the tail redraws
    ("normal_", torch.float64, 33, 5, 0, 3),
    ("normal_", torch.bfloat16, 64, 9, 30, 41),
    ("normal_", torch.float16, 17, 17, 16, 17),
    ("uniform_", torch.float32, 100, 3, 50, 75),
    ("uniform_", torch.float64, 10, 10, 9, 10),
    ("uniform_", torch.bfloat16, 8, 1000, 2, 3),
]


@pytest.mark.parametrize("kernel, dtype, rows, cols, a, b", CASES)
def test_a_shard_draws_only_its_rows(kernel, dtype, rows, cols, a, b):
    torch.manual_seed(0)
    eager = Sharded(kernel, dtype, rows, cols, a, b)
    eager_next = torch.rand(4)
    torch.manual_seed(0)
    m = deferred_init(Sharded, kernel, dtype, rows, cols, a, b)
    ran = random_kernels(lambda: materialize_tensor(m.shard))
    assert torch.equal(m.shard, eager.shard)
    # The shard's own draw ran on its part only (and, for normal_, on the blocks
    # of 16 it meets and the last 16 elements), never on the whole tensor.
    full = rows * cols
    sizes = [math.prod(s) for name, s in ran if name == f"aten::{kernel}"]
    assert sizes and all(n < full for n in sizes), sizes
    assert sum(sizes) <= (b - a) * cols + 46
    assert not any(name == "aten::uniform_" and s == (16, 16) for name, s in ran)  # `before` jumped over
    materialize_module(m)
    assert_same_tensors(eager, m)
    assert torch.equal(torch.rand(4), eager_next)


def test_a_non_contiguous_draw_is_drawn_whole():
    """Rows of a transposed draw are no stretch of its words: drawn whole, still exact."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            full = torch.empty(30, 20).t().normal_()
            self.shard = nn.Parameter(full[3:5].clone())

    torch.manual_seed(0)
    eager = M()
    torch.manual_seed(0)
    m = deferred_init(M)
    ran = random_kernels(lambda: materialize_module(m))
    assert_same_tensors(eager, m)
    assert [s for _, s in ran] == [(20, 30)]


@pytest.mark.parametrize("world, rank", [(4, 0), (4, 3), (3, 1)])
def test_an_fsdp2_rank_draws_its_own_rows(world, rank):
    """One rank of FSDP2 (PyTorch's fake process group) over a transformers Llama:
    its shards equal the eager model's slices and its draws are its rows only."""
    transformers = pytest.importorskip("transformers")
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    eager = transformers.LlamaForCausalLM(config)
    expected = {name: torch.chunk(p.detach(), world)[rank] for name, p in eager.named_parameters()}
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        m = deferred_init(transformers.LlamaForCausalLM, config)
        for layer in m.model.layers:
            fully_shard(layer)
        fully_shard(m)
        ran = random_kernels(lambda: materialize_module(m))
        for name, p in m.named_parameters():
            assert torch.equal(p._local_tensor, expected[name]), name
    finally:
        dist.destroy_process_group()
    total = sum(p.numel() for p in eager.parameters())
    drawn = sum(math.prod(s) for _, s in ran)
    # The rank's rows of each draw, the blocks of 16 they meet and the last 16 elements.
    assert ran and drawn <= total / world + 46 * len(ran), (drawn, total)


# -- the corpora: what is generated instead of jumped over ------------------------

def documented_fallbacks() -> set:
    """The calls named in the first column of docs/materialize.md's table."""
    with open(os.path.join(ROOT, "docs", "materialize.md")) as f:
        text = f.read()
    section = text.split("### Draws generated instead of jumped over", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return {name for cell in rows for name in re.findall(r"`([^`]+)`", cell)}


def corpora():
    from test_exact import MODULES

    models = {f"torch.nn {name}": (build, ()) for name, build in MODULES.items()}
    try:
        from test_transformers import CORPUS
    except pytest.skip.Exception:
        CORPUS = {}
    models.update({f"transformers {name}": (cls, (config,)) for name, (cls, config) in CORPUS.items()})
    return models


CORPORA = corpora()


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", list(CORPORA))
def test_corpora_fallbacks_are_the_documented_ones(name):
    """Materialized tensor by tensor in reverse (every tensor's earlier draws
    are moved past), each corpus model equals eager; every draw generated
    instead of jumped over is one of the calls docs/materialize.md lists."""
    build, args = CORPORA[name]
    torch.manual_seed(0)
    eager = build(*args)
    eager_next = torch.rand(4)
    torch.manual_seed(0)
    m = deferred_init(build, *args)
    before = FALLBACKS.copy()
    materialize_in_order(m, "reverse")
    assert_same_tensors(eager, m)
    assert torch.equal(torch.rand(4), eager_next)
    generated = set(FALLBACKS - before)
    assert generated <= documented_fallbacks(), generated


# -- reseeds after deferral (deferinit.random.record.Lineage) ----------------------------


class Layers(nn.Module):
    """A big normal_ draw (over the 4M words drawing pays for: jumped), then six small layers."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(2500, 2000)  # 5M normal samples
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(6))


RESEEDS = {
    "manual_seed(1)": lambda: torch.manual_seed(1),
    "manual_seed(0), the seed before": lambda: torch.manual_seed(0),
    "set_rng_state(another state)": lambda: torch.set_rng_state(torch.Generator().manual_seed(7).get_state()),
}


@pytest.mark.filterwarnings("ignore::deferinit.PendingDrawsWarning")
@pytest.mark.parametrize("reseed", list(RESEEDS))
def test_a_reseed_after_deferral_then_one_layer_equals_eager(reseed):
    """The replay jumps from the record's own states, the hand-over follows the
    generator's lineage: one layer after a reseed is eager's layer (its earlier
    draws jumped over, not drawn), the generator stays where the reseed put it,
    and the rest materialized later is eager's too."""
    torch.manual_seed(0)
    eager = Layers()
    RESEEDS[reseed]()
    eager_next = torch.rand(8)

    torch.manual_seed(0)
    m = deferred_init(Layers)
    RESEEDS[reseed]()
    ran = random_kernels(lambda: materialize_module(m.layers[4]))
    assert_same_tensors(eager.layers[4], m.layers[4])
    # Only layer 4's own draws ran: the embedding's 5M samples and the other layers were jumped over.
    assert ran and all(math.prod(s) <= 32 * 32 for _, s in ran), ran
    materialize_module(m)
    assert_same_tensors(eager, m)
    assert torch.equal(torch.rand(8), eager_next), f"after {reseed}, the generator differs from eager's"
