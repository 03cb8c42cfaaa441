"""A built-in Llama-3-70B-shaped model in plain ``torch.nn``, and ``deferinit demo``.

The model has the parameter layout of Llama 3 70B (80 decoder layers, hidden
size 8192, MLP size 28672, vocabulary 128256, 64 query heads and 8 key/value
heads, so the k/v projections are 8192 x 1024, RMSNorm) and is built the
usual way: embedding first, then the layers, the final norm and the output
head.  Every ``nn.Linear`` and ``nn.Embedding`` keeps PyTorch's default
initialisation, so the reference for exactness is plain eager PyTorch.
It describes shapes only: there is no forward pass.

Example::

    >>> from deferinit import deferred_init
    >>> model = deferred_init(Llama, LLAMA_70B, dtype=torch.bfloat16)   # ~50 ms, no memory
    >>> sum(p.numel() for p in model.parameters())
    70553706496
"""

from __future__ import annotations

import dataclasses
import os
import resource
import sys
import time

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """The sizes that fix a Llama model's parameters."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rms_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def describe(self) -> str:
        """Example: ``LLAMA_70B.describe()`` -> ``'80 layers, d=8192, ffn=28672, ...'``."""
        return (
            f"{self.num_layers} layers, d={self.hidden_size}, ffn={self.intermediate_size}, "
            f"vocab={self.vocab_size}, {self.num_heads} heads, {self.num_kv_heads} kv heads"
        )


#: Llama 3 70B (and 3.1/3.3 70B): 70.55 B parameters.
LLAMA_70B = LlamaShape(
    vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8
)

#: The same architecture at toy size, for tests and quick looks.
LLAMA_TINY = LlamaShape(vocab_size=256, hidden_size=64, intermediate_size=160, num_layers=4, num_heads=4, num_kv_heads=2)

SHAPES = {"70b": LLAMA_70B, "tiny": LLAMA_TINY}


class Attention(nn.Module):
    """Grouped-query attention projections (no bias)."""

    def __init__(self, shape: LlamaShape, device=None, dtype=None):
        super().__init__()
        kw = dict(bias=False, device=device, dtype=dtype)
        d, kv = shape.hidden_size, shape.num_kv_heads * shape.head_dim
        self.q_proj = nn.Linear(d, d, **kw)
        self.k_proj = nn.Linear(d, kv, **kw)
        self.v_proj = nn.Linear(d, kv, **kw)
        self.o_proj = nn.Linear(d, d, **kw)


class MLP(nn.Module):
    """The SwiGLU feed-forward projections (no bias)."""

    def __init__(self, shape: LlamaShape, device=None, dtype=None):
        super().__init__()
        kw = dict(bias=False, device=device, dtype=dtype)
        d, f = shape.hidden_size, shape.intermediate_size
        self.gate_proj = nn.Linear(d, f, **kw)
        self.up_proj = nn.Linear(d, f, **kw)
        self.down_proj = nn.Linear(f, d, **kw)


class DecoderLayer(nn.Module):
    """One Llama block, built in the order of HuggingFace's ``LlamaDecoderLayer``."""

    def __init__(self, shape: LlamaShape, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.self_attn = Attention(shape, **kw)
        self.mlp = MLP(shape, **kw)
        self.input_layernorm = nn.RMSNorm(shape.hidden_size, eps=shape.rms_norm_eps, **kw)
        self.post_attention_layernorm = nn.RMSNorm(shape.hidden_size, eps=shape.rms_norm_eps, **kw)


class Llama(nn.Module):
    """A Llama-shaped ``nn.Module``: ``embed_tokens``, ``layers``, ``norm``, ``lm_head``.

    Example::

        >>> m = Llama(LLAMA_TINY)
        >>> [name for name, _ in m.named_children()]
        ['embed_tokens', 'layers', 'norm', 'lm_head']
    """

    def __init__(self, shape: LlamaShape = LLAMA_70B, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.shape = shape
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size, **kw)
        self.layers = nn.ModuleList(DecoderLayer(shape, **kw) for _ in range(shape.num_layers))
        self.norm = nn.RMSNorm(shape.hidden_size, eps=shape.rms_norm_eps, **kw)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False, **kw)


def eager_first_block(shape: LlamaShape, *, seed: int, dtype=None) -> DecoderLayer:
    """``layers[0]`` of ``Llama(shape)`` built eagerly from ``torch.manual_seed(seed)``.

    What precedes the block in construction order (the embedding) is built
    first, because its random draws advance the generator, then dropped.

    Example::

        >>> block = eager_first_block(LLAMA_TINY, seed=0)
        >>> torch.manual_seed(0); torch.equal(block.mlp.up_proj.weight, Llama(LLAMA_TINY).layers[0].mlp.up_proj.weight)
        True
    """
    torch.manual_seed(seed)
    embedding = nn.Embedding(shape.vocab_size, shape.hidden_size, dtype=dtype)
    del embedding
    return DecoderLayer(shape, dtype=dtype)


# -- deferinit demo -----------------------------------------------------------------


def peak_rss_bytes() -> int:
    """The peak resident memory of this process so far, in bytes.

    Example::

        >>> peak_rss_bytes() >= rss_bytes()
        True
    """
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def rss_bytes() -> int:
    """The resident memory of this process now (Linux; elsewhere the peak), in bytes.

    Example::

        >>> before = rss_bytes(); m = deferred_init(Llama, LLAMA_70B); rss_bytes() - before < 2**30
        True
    """
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def run_demo(*, size: str = "70b", seed: int = 0, output: str = "deferinit-demo.svg", out=None) -> int:
    """``deferinit demo``: defer a Llama-shaped model, inspect it, draw it, check one block.

    Returns the exit status: 0 when the materialized block equals eager
    construction bit for bit, 1 otherwise.

    Example::

        >>> run_demo(size="tiny", output="/tmp/demo.dot")
        0
    """
    from materialize import materialize_module

    from . import cli, dot
    from .session import deferred_init, is_deferred

    out = out if out is not None else sys.stdout
    shape = SHAPES[size]
    dtype = torch.bfloat16
    started = time.perf_counter()
    name = {"70b": "LLAMA_70B", "tiny": "LLAMA_TINY"}[size]
    call = f"deferinit.demo:Llama({name}, dtype=torch.bfloat16)"

    def say(text=""):
        print(text, file=out, flush=True)

    say(f"deferinit demo: a Llama-3-{size.upper()}-shaped model in plain torch.nn")
    say(f"({shape.describe()}), bfloat16, seed {seed}")
    say()

    # 1. Defer.
    torch.manual_seed(seed)
    rss_before = rss_bytes()
    t0 = time.perf_counter()
    model = deferred_init(Llama, shape, dtype=dtype)
    deferral = time.perf_counter() - t0
    grown = rss_bytes() - rss_before
    n_params = sum(p.numel() for p in model.parameters())
    say(
        f"1. Defer: deferred_init(Llama, {name}, dtype=torch.bfloat16) took {cli.fmt_seconds(deferral)}; "
        f"resident memory grew by {cli.fmt_bytes(max(grown, 0))},"
    )
    say(
        f"   for {cli.fmt_count(n_params)} parameters that would take {cli.fmt_bytes(n_params * dtype.itemsize)}."
    )
    say()

    # 2. Inspect.
    say("2. Inspect (what `deferinit inspect` prints):")
    say("   " + cli.format_report(cli.summarize(model), deferral, title=call, grown=grown).replace("\n", "\n   "))
    say()

    # 3. Draw.
    t0 = time.perf_counter()
    graph = dot.to_dot(model)
    try:
        written = dot.write(graph, output)
        say(
            f"3. Draw: wrote {written} in {cli.fmt_seconds(time.perf_counter() - t0)}: the record of the whole model, "
            f"its {shape.num_layers} identical decoder layers drawn as one block marked x{shape.num_layers}."
        )
    except dot.GraphvizNotFoundError as e:
        say(f"3. Draw: {e}")
    say()

    # 4. Materialize one block and compare with eager PyTorch.
    block = model.layers[0]
    t0 = time.perf_counter()
    materialize_module(block, device="cpu")
    replayed = time.perf_counter() - t0
    block_bytes = sum(p.numel() * p.element_size() for p in block.parameters())
    say(
        f"4. Check: materialize_module(model.layers[0], device='cpu') took {cli.fmt_seconds(replayed)} for "
        f"{cli.fmt_bytes(block_bytes)}"
    )
    say("   (the embedding's draws, which come first, were replayed to reach the generator state, then freed).")
    t0 = time.perf_counter()
    eager = eager_first_block(shape, seed=seed, dtype=dtype)
    eager_time = time.perf_counter() - t0
    mine = dict(block.named_parameters())
    theirs = dict(eager.named_parameters())
    same = mine.keys() == theirs.keys() and all(
        mine[n].dtype == p.dtype and torch.equal(mine[n], p) for n, p in theirs.items()
    )
    say(
        f"   Eager PyTorch (torch.manual_seed({seed}); nn.Embedding; DecoderLayer) took {cli.fmt_seconds(eager_time)}: "
        f"the {len(theirs)} tensors are {'bit-identical' if same else 'DIFFERENT'}."
    )
    del eager
    say()
    say(
        f"Done in {cli.fmt_seconds(time.perf_counter() - started)}, peak resident memory "
        f"{cli.fmt_bytes(peak_rss_bytes())}; the other {sum(1 for p in model.parameters() if is_deferred(p))} "
        "tensors are still deferred."
    )
    return 0 if same else 1
