"""A built-in Llama-3-70B-shaped model in plain ``torch.nn``, and ``deferinit demo``.

The model has the parameter layout of Llama 3 70B (80 decoder layers, hidden
size 8192, MLP size 28672, vocabulary 128256, 64 query heads and 8 key/value
heads, so the k/v projections are 8192 x 1024, RMSNorm) and is built the
usual way: embedding first, then the layers, the final norm and the output
head.  Every ``nn.Linear`` and ``nn.Embedding`` keeps PyTorch's default
initialisation, so the reference for exactness is plain eager PyTorch.
Its forward pass (token ids in, logits out; rotary position embeddings,
grouped-query causal attention through ``scaled_dot_product_attention``,
SwiGLU) is Llama's, so a training step can be planned on it
(``deferinit plan deferinit.demo:Llama``).

Example::

    >>> from deferinit import deferred_init
    >>> model = deferred_init(Llama, LLAMA_70B, dtype=torch.bfloat16)   # ~50 ms, no memory
    >>> sum(p.numel() for p in model.parameters())
    70553706496
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
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
    rope_theta: float = 500000.0

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
        self.head_dim = shape.head_dim

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotary(shape: LlamaShape, length: int, device, dtype):
    """The cosines and sines of rotary position embeddings for ``length`` positions."""
    inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, shape.head_dim, 2, device=device).float() / shape.head_dim))
    angles = torch.outer(torch.arange(length, device=device).float(), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


class MLP(nn.Module):
    """The SwiGLU feed-forward projections (no bias)."""

    def __init__(self, shape: LlamaShape, device=None, dtype=None):
        super().__init__()
        kw = dict(bias=False, device=device, dtype=dtype)
        d, f = shape.hidden_size, shape.intermediate_size
        self.gate_proj = nn.Linear(d, f, **kw)
        self.up_proj = nn.Linear(d, f, **kw)
        self.down_proj = nn.Linear(f, d, **kw)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """One Llama block, built in the order of HuggingFace's ``LlamaDecoderLayer``."""

    def __init__(self, shape: LlamaShape, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.self_attn = Attention(shape, **kw)
        self.mlp = MLP(shape, **kw)
        self.input_layernorm = nn.RMSNorm(shape.hidden_size, eps=shape.rms_norm_eps, **kw)
        self.post_attention_layernorm = nn.RMSNorm(shape.hidden_size, eps=shape.rms_norm_eps, **kw)

    def forward(self, x, cos, sin):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


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

    def forward(self, input_ids):
        """Logits for token ids of shape ``(batch, sequence)``."""
        x = self.embed_tokens(input_ids)
        cos, sin = rotary(self.shape, input_ids.shape[1], x.device, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


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
