"""A sample of real models for the CUDA checks: transformers, diffusers, timm
and torch.nn, each from a small config (nothing is downloaded)."""

from __future__ import annotations

import importlib
import importlib.util

import torch


def _transformers(name: str, config_name: str, **config):
    def build():
        import transformers

        transformers.logging.set_verbosity_error()
        return getattr(transformers, name)(getattr(transformers, config_name)(**config))

    return build


def _diffusers(name: str, **config):
    def build():
        import diffusers

        return getattr(diffusers, name)(**config)

    return build


def _timm(name: str, **kwargs):
    def build():
        import timm

        return timm.create_model(name, pretrained=False, **kwargs)

    return build


def _nn_transformer():
    return torch.nn.Transformer(d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=64)


SMALL = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=128)

# (id, library the builder needs, builder)
MODELS = [
    ("llama", "transformers", _transformers("LlamaForCausalLM", "LlamaConfig", num_key_value_heads=2, **SMALL)),
    ("gpt2", "transformers", _transformers("GPT2LMHeadModel", "GPT2Config", n_embd=32, n_layer=2, n_head=4, vocab_size=128)),
    ("bert", "transformers", _transformers("BertForMaskedLM", "BertConfig", **SMALL)),
    ("t5", "transformers", _transformers("T5ForConditionalGeneration", "T5Config", d_model=32, d_ff=64, d_kv=8,
                                         num_layers=2, num_heads=4, vocab_size=128)),
    ("unet", "diffusers", _diffusers("UNet2DConditionModel", sample_size=8, in_channels=4, out_channels=4,
                                     block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=32,
                                     down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                     up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), norm_num_groups=8)),
    ("vae", "diffusers", _diffusers("AutoencoderKL", block_out_channels=(32, 64), latent_channels=4, norm_num_groups=8,
                                    down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2)),
    ("vit", "timm", _timm("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2)),
    ("nn-transformer", "torch", _nn_transformer),
]


def missing_library(library: str) -> str | None:
    """Why a model of ``library`` cannot be built here, or None."""
    if library == "torch":
        return None
    if importlib.util.find_spec(library) is None:
        return f"{library} is not installed"
    try:
        importlib.import_module(library)
    except Exception as e:  # noqa: BLE001 - timm without a working torchvision
        return f"{library} cannot be imported: {type(e).__name__}: {e}"
    return None


