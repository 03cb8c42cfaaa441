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
