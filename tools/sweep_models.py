"""Sweep real model classes: deferred_init + materialize_module against eager.

A tool, not a test (``make test`` does not run it): it builds every model
class it can make tiny -- transformers' auto-mapped classes from shrunk
configs, diffusers' models from small constructor arguments, torch.nn's
modules -- eagerly and deferred from the same seed, and compares every
parameter and buffer (values bit for bit, NaNs included, dtype, shape,
strides, requires_grad, class, ties) and what the default generator draws
next.  A sample is also materialized submodule by submodule in reverse.

    HF_HUB_OFFLINE=1 python tools/sweep_models.py --lib torch,diffusers,transformers \
        --out /tmp/sweep.json [--repo PATH] [--only llama,bert] [--heads base|all]

``--repo`` is the tree whose packages are swept (default: this one), so the
same script can sweep an older commit checked out elsewhere.  Each model ends
EQUAL, DIFFERENT (the first differing tensor and how), ERROR (in deferral or
materialization, with the message) or SKIPPED (eager build failed or was
slower than ``--eager-limit`` seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import signal
import sys
import time
import traceback
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))


class Timeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds):
    def fire(signum, frame):
        raise Timeout(f"over {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@contextlib.contextmanager
def quiet_build(seconds):
    """How every build of the sweep runs: within ``seconds``, its warnings silenced."""
    with time_limit(seconds), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# --------------------------------------------------------------- comparison


def named_tensors(module):
    out = dict(module.named_parameters(remove_duplicate=False))
    out.update(module.named_buffers(remove_duplicate=False))
    return out


def same_values(x, y):
    import torch

    x, y = x.detach(), y.detach()
    if x.is_complex():
        return same_values(torch.view_as_real(x), torch.view_as_real(y))
    if torch.equal(x, y):
        return True
    if x.is_floating_point():
        nx, ny = torch.isnan(x), torch.isnan(y)
        return torch.equal(nx, ny) and torch.equal(torch.where(nx, 0, x), torch.where(ny, 0, y))
    return False


def difference(eager, deferred):
    """None when equal, else a description of the first difference."""
    import torch

    a, b = named_tensors(eager), named_tensors(deferred)
    if a.keys() != b.keys():
        return f"names differ: eager-only {sorted(a.keys() - b.keys())[:5]}, deferred-only {sorted(b.keys() - a.keys())[:5]}"
    for name in a:
        x, y = a[name], b[name]
        if type(x) is not type(y):
            return f"{name}: class {type(x).__name__} vs {type(y).__name__}"
        if isinstance(x, torch.nn.parameter.UninitializedTensorMixin):
            continue
        for attr in ("dtype", "shape", "requires_grad"):
            if getattr(x, attr) != getattr(y, attr):
                return f"{name}: {attr} {getattr(x, attr)} vs {getattr(y, attr)}"
        if x.device.type != y.device.type:
            return f"{name}: device {x.device} vs {y.device}"
        if getattr(x, "is_meta", False) or x.device.type == "meta":
            continue
        if x.stride() != y.stride():
            return f"{name}: stride {x.stride()} vs {y.stride()}"
        if type(y).__name__ == "FakeTensor" or "Fake" in type(y).__name__:
            return f"{name}: still fake after materialization"
        if not same_values(x, y):
            return f"{name}: values differ (shape {tuple(x.shape)}, {x.dtype})"
    ids_a = {n: id(t) for n, t in a.items()}
    ids_b = {n: id(t) for n, t in b.items()}
    names = list(a)
    for i, n1 in enumerate(names):
        for n2 in names[i + 1 :]:
            if (ids_a[n1] == ids_a[n2]) != (ids_b[n1] == ids_b[n2]):
                return f"tie {n1} / {n2}: eager {ids_a[n1] == ids_a[n2]}, deferred {ids_b[n1] == ids_b[n2]}"
    return None


def state_problem(before):
    import torch

    now = (
        torch._C._len_torch_function_stack(),
        torch._C._len_torch_dispatch_stack(),
        torch.get_default_dtype(),
        torch.is_grad_enabled(),
    )
    if now != before:
        # Put it back so one model's leak cannot spoil the rest.
        while torch._C._len_torch_function_stack() > before[0]:
            torch._C._pop_torch_function_stack()
        while torch._C._len_torch_dispatch_stack() > before[1]:
            torch._C._pop_torch_dispatch_stack(None)
        torch.set_default_dtype(before[2])
        torch._C._set_grad_enabled(before[3])
        return f"global state left changed: {before} -> {now}"
    return None


def short(exc):
    lines = [line for line in traceback.format_exception_only(type(exc), exc) if line.strip()]
    text = " ".join(line.strip() for line in lines).replace("\n", " ")
    return text[:400]


def check(build, reverse=False, eager_limit=20.0, limit=60.0):
    """Classify one model: (status, detail, seconds)."""
    import torch
    from deferinit import deferred_init
    from deferinit.materialize import materialize_module

    before = (
        torch._C._len_torch_function_stack(),
        torch._C._len_torch_dispatch_stack(),
        torch.get_default_dtype(),
        torch.is_grad_enabled(),
    )
    t0 = time.perf_counter()
    try:
        torch.manual_seed(0)
        with quiet_build(eager_limit):
            eager = build()
        after = torch.rand(8)
    except Exception as exc:
        state_problem(before)
        return "SKIPPED", f"eager: {short(exc)}", time.perf_counter() - t0
    eager_s = time.perf_counter() - t0
    phase = "deferral"
    try:
        with quiet_build(limit):
            torch.manual_seed(0)
            deferred = deferred_init(build)
            leak = state_problem(before)
            if leak:
                return "ERROR", f"deferral: {leak}", time.perf_counter() - t0
            phase = "materialization"
            materialize_module(deferred)
            drawn = torch.rand(8)
    except Exception as exc:
        leak = state_problem(before)
        return "ERROR", f"{phase}: {short(exc)}" + (f" [{leak}]" if leak else ""), time.perf_counter() - t0
    leak = state_problem(before)
    if leak:
        return "ERROR", f"materialization: {leak}", time.perf_counter() - t0
    try:
        diff = difference(eager, deferred)
    except Exception as exc:
        diff = f"comparison failed: {short(exc)}"
    if diff is None and not torch.equal(drawn, after):
        diff = "default generator after materialization differs from eager's"
    if diff is None and reverse:
        phase = "reverse materialization"
        try:
            with quiet_build(limit):
                torch.manual_seed(0)
                deferred = deferred_init(build)
                torch.rand(3)  # the generator moves in between
                for _, sub in reversed(list(deferred.named_modules())):
                    materialize_module(sub)
        except Exception as exc:
            state_problem(before)
            return "ERROR", f"{phase}: {short(exc)}", time.perf_counter() - t0
        diff = difference(eager, deferred)
        if diff is not None:
            diff = f"reverse order: {diff}"
    del eager
    if diff is not None:
        return "DIFFERENT", diff, time.perf_counter() - t0
    return "EQUAL", f"eager {eager_s:.2f} s", time.perf_counter() - t0


# ------------------------------------------------------------- transformers

# attribute -> small value, set where a config has the attribute.
SMALL = {
    "hidden_size": 32, "d_model": 32, "n_embd": 32, "n_embed": 32, "d_embed": 32, "embed_dim": 32,
    "dim": 32, "hidden_dim": 32, "model_dim": 32, "emb_dim": 32, "embedding_size": 32, "word_embed_proj_dim": 32,
    "projection_dim": 32, "projection_size": 32, "text_embed_dim": 32, "vision_embed_dim": 32,
    "intermediate_size": 64, "ffn_dim": 64, "d_ff": 64, "n_inner": 64, "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64, "ffn_hidden_size": 64, "mlp_dim": 64, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "expert_intermediate_size": 32,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2, "encoder_layers": 2, "decoder_layers": 2,
    "num_decoder_layers": 2, "num_encoder_layers": 2, "depth": 2,
    "num_attention_heads": 2, "n_head": 2, "n_heads": 2, "num_heads": 2, "encoder_attention_heads": 2,
    "decoder_attention_heads": 2, "num_key_value_heads": 2, "num_kv_heads": 2, "n_kv_heads": 2,
    "head_dim": 16, "kv_channels": 16, "d_kv": 16, "attention_head_dim": 16,
    "vocab_size": 128, "max_position_embeddings": 128, "n_positions": 128, "n_ctx": 128,
    "num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
    "image_size": 32, "patch_size": 8, "num_channels": 3,
}
LAYER_KEYS = {"num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers", "decoder_layers",
              "num_decoder_layers", "num_encoder_layers", "depth"}
# Lists whose length follows the number of layers or stages.
LIST_KEYS = {"hidden_sizes": 32, "depths": 1, "embed_dims": 32, "num_heads_list": 2}


def shrink_kwargs(config, depth=0):
    """Constructor keyword arguments that make ``config`` tiny (sub-configs as dicts)."""
    from transformers import PretrainedConfig

    out = {}
    layer_counts = {v for k, v in vars(config).items() if k in LAYER_KEYS and isinstance(v, int) and v > 2}
    for key, value in list(vars(config).items()):
        if key.startswith("_"):
            continue
        if isinstance(value, list) and len(value) in layer_counts and key not in LIST_KEYS:
            out[key] = value[:2]  # per-layer lists (layer_types) follow the layer count
            continue
        if isinstance(value, dict) and "mrope_section" in value:
            out[key] = dict(value, mrope_section=[2, 3, 3])  # sums to head_dim / 2
            continue
        if isinstance(value, PretrainedConfig) and depth < 3:
            sub = value.to_dict()
            sub.update(shrink_kwargs(value, depth + 1))
            out[key] = sub
        elif key in SMALL and isinstance(value, int) and not isinstance(value, bool):
            out[key] = min(value, SMALL[key]) if value > 0 else value
        elif key in LIST_KEYS and isinstance(value, (list, tuple)) and value and all(isinstance(v, int) for v in value):
            out[key] = type(value)(min(v, LIST_KEYS[key]) for v in value)
    return out


def transformers_cases(heads, only):
    from transformers import AutoConfig
    from transformers.models.auto import modeling_auto as ma
    import transformers

    order = ["MODEL_MAPPING_NAMES", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"]
    if heads == "all":
        order += sorted(n for n in dir(ma) if n.endswith("_MAPPING_NAMES") and n not in order)
    seen = set()
    for mapping in order:
        names = getattr(ma, mapping)
        if not isinstance(names, dict):
            continue
        for model_type, classes in names.items():
            if only and model_type not in only:
                continue
            for cls_name in classes if isinstance(classes, (tuple, list)) else [classes]:
                if (model_type, cls_name) in seen or cls_name.endswith("Config"):
                    continue
                seen.add((model_type, cls_name))

                def build(model_type=model_type, cls_name=cls_name):
                    cls = getattr(transformers, cls_name)
                    config = AutoConfig.for_model(model_type)
                    small = AutoConfig.for_model(model_type, **shrink_kwargs(config))
                    return cls(small)

                yield f"transformers.{cls_name} ({model_type})", build


# ---------------------------------------------------------------- diffusers

DIFFUSERS = {
    "UNet2DModel": dict(sample_size=8, in_channels=3, out_channels=3, block_out_channels=(16, 32), layers_per_block=1,
                        down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
                        norm_num_groups=8, attention_head_dim=8),
    "UNet2DConditionModel": dict(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(16, 32), layers_per_block=1,
                                 down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=16,
                                 norm_num_groups=8, attention_head_dim=8),
    "UNet1DModel": dict(block_out_channels=(8, 16, 16), in_channels=2, out_channels=2, extra_in_channels=16,
                        down_block_types=("DownBlock1DNoSkip", "DownBlock1D", "AttnDownBlock1D"),
                        up_block_types=("AttnUpBlock1D", "UpBlock1D", "UpBlock1DNoSkip"), mid_block_type="UNetMidBlock1D"),
    "UNet3DConditionModel": dict(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(16, 32), layers_per_block=1,
                                 down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"),
                                 up_block_types=("UpBlock3D", "CrossAttnUpBlock3D"), cross_attention_dim=16,
                                 norm_num_groups=8, attention_head_dim=8),
    "AutoencoderKL": dict(in_channels=3, out_channels=3, block_out_channels=(16, 32), latent_channels=4,
                          down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
                          up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), norm_num_groups=8, sample_size=16),
    "AutoencoderTiny": dict(encoder_block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
                            num_encoder_blocks=(1, 1), num_decoder_blocks=(1, 1), latent_channels=4),
    "VQModel": dict(block_out_channels=(16, 32), down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
                    up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), norm_num_groups=8, latent_channels=4,
                    num_vq_embeddings=32, vq_embed_dim=4),
    "DiTTransformer2DModel": dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, num_layers=2,
                                  sample_size=8, patch_size=2, norm_num_groups=4, num_embeds_ada_norm=10),
    "PixArtTransformer2DModel": dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
                                     sample_size=8, patch_size=2, cross_attention_dim=16, caption_channels=16,
                                     norm_num_groups=4),
    "Transformer2DModel": dict(num_attention_heads=2, attention_head_dim=8, in_channels=8, num_layers=1, norm_num_groups=4),
    "SD3Transformer2DModel": dict(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                                  num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                                  pooled_projection_dim=16, out_channels=4, pos_embed_max_size=16),
    "FluxTransformer2DModel": dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8,
                                   num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=16,
                                   axes_dims_rope=(2, 2, 4)),
    "PriorTransformer": dict(num_attention_heads=2, attention_head_dim=8, num_layers=1, embedding_dim=16, num_embeddings=4,
                             additional_embeddings=4),
    "ControlNetModel": dict(in_channels=4, block_out_channels=(16, 32), layers_per_block=1,
                            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), cross_attention_dim=16,
                            norm_num_groups=8, attention_head_dim=8, conditioning_embedding_out_channels=(8, 16)),
}
# Generic shrinking of constructor parameters for the classes not listed.
DIFFUSERS_SMALL = {
    "num_attention_heads": 2, "attention_head_dim": 8, "num_layers": 1, "num_single_layers": 1, "num_refiner_layers": 1,
    "layers_per_block": 1, "cross_attention_dim": 16, "joint_attention_dim": 16, "caption_channels": 16,
    "pooled_projection_dim": 16, "text_embed_dim": 16, "hidden_size": 16, "num_layers_per_block": 1,
    "norm_num_groups": 4, "sample_size": 8, "sample_width": 8, "sample_height": 8, "sample_frames": 2,
    "num_frames": 2, "in_channels": 4, "out_channels": 4, "latent_channels": 4, "caption_projection_dim": 16,
    "text_dim": 16, "freq_dim": 16, "ffn_dim": 32, "vocab_size": 32, "max_position_embeddings": 32, "time_embed_dim": 16,
}


def shrink_channels(value, small=16):
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, int) for v in value):
        return type(value)(small * (1 + i % 2) for i in range(len(value)))
    return value


def diffusers_cases(only):
    import diffusers
    from diffusers import ModelMixin

    names = sorted(n for n in dir(diffusers) if not n.startswith("_"))
    for name in names:
        if only and name not in only:
            continue
        try:
            cls = getattr(diffusers, name)
        except Exception:
            continue
        if not (isinstance(cls, type) and issubclass(cls, ModelMixin)) or cls is ModelMixin:
            continue
        kwargs = DIFFUSERS.get(name)
        if kwargs is None:
            kwargs = {}
            try:
                params = inspect.signature(cls.__init__).parameters
            except (TypeError, ValueError):
                params = {}
            for p, spec in params.items():
                if p in DIFFUSERS_SMALL and isinstance(spec.default, int) and not isinstance(spec.default, bool):
                    kwargs[p] = min(spec.default, DIFFUSERS_SMALL[p]) if spec.default else DIFFUSERS_SMALL[p]
                elif p == "block_out_channels":
                    kwargs[p] = shrink_channels(spec.default)
                elif p == "axes_dims_rope" and isinstance(spec.default, (tuple, list)):
                    kwargs[p] = (2, 2, 4)
            if "attention_head_dim" in kwargs and "axes_dims_rope" in kwargs:
                kwargs["attention_head_dim"] = 8

        def build(cls=cls, kwargs=kwargs):
            return cls(**kwargs)

        yield f"diffusers.{name}", build


# ------------------------------------------------------------------ torch.nn

NN_SMALL = {
    "in_features": 5, "out_features": 3, "in1_features": 3, "in2_features": 4, "in_channels": 4, "out_channels": 6,
    "kernel_size": 3, "num_features": 4, "normalized_shape": 6, "embed_dim": 8, "num_heads": 2, "d_model": 8,
    "nhead": 2, "dim_feedforward": 16, "num_encoder_layers": 1, "num_decoder_layers": 1, "input_size": 4,
    "hidden_size": 6, "num_layers": 2, "num_embeddings": 10, "embedding_dim": 4, "num_groups": 2, "num_channels": 4,
    "n_classes": 10, "cutoffs": [4, 8], "num_parameters": 3, "size": 4, "output_size": 2, "upscale_factor": 2,
    "downscale_factor": 2, "dim": 1, "p": 0.5, "lambd": 0.5, "min_val": -1.0, "max_val": 1.0, "threshold": 0.1,
    "value": 0.0, "padding": 1, "norm_type": 2.0, "groups": 2, "num_classes": 10, "unflattened_size": (2, 3), "encoder_layer": None, "decoder_layer": None, "scale_factor": 2,
}
NN_VARIANTS = {
    "Linear": [dict(bias=False), dict(dtype="float64"), dict(dtype="bfloat16")],
    "Conv2d": [dict(groups=2), dict(padding_mode="circular"), dict(dtype="float16")],
    "ConvTranspose2d": [dict(groups=2)],
    "LSTM": [dict(bidirectional=True, proj_size=2), dict(batch_first=True, bias=False)],
    "GRU": [dict(bidirectional=True)],
    "RNN": [dict(nonlinearity="relu", bidirectional=True)],
    "MultiheadAttention": [dict(kdim=3, vdim=5), dict(bias=False, add_bias_kv=True), dict(add_zero_attn=True, batch_first=True)],
    "Embedding": [dict(padding_idx=0), dict(max_norm=1.0), dict(sparse=True)],
    "EmbeddingBag": [dict(padding_idx=1, mode="max")],
    "BatchNorm1d": [dict(affine=False), dict(track_running_stats=False), dict(momentum=None)],
    "LayerNorm": [dict(elementwise_affine=False), dict(bias=False), dict(normalized_shape=(2, 3))],
    "GroupNorm": [dict(affine=False)],
    "Transformer": [dict(norm_first=True, batch_first=True)],
    "TransformerEncoderLayer": [dict(norm_first=True), dict(bias=False)],
    "PReLU": [dict(init=0.1)],
    "Bilinear": [dict(bias=False)],
}


def nn_cases(only):
    import torch
    import torch.nn as nn

    def small_args(cls, extra):
        kwargs = {}
        params = inspect.signature(cls.__init__).parameters
        for p, spec in params.items():
            if p == "self" or spec.kind in (spec.VAR_POSITIONAL, spec.VAR_KEYWORD):
                continue
            if p in extra:
                kwargs[p] = getattr(torch, extra[p]) if p == "dtype" else extra[p]
            elif spec.default is inspect.Parameter.empty:
                if p not in NN_SMALL:
                    raise TypeError(f"no small value for {p!r}")
                kwargs[p] = NN_SMALL[p]
        if cls.__name__ in ("RNN", "LSTM", "GRU"):
            kwargs.update(input_size=4, hidden_size=6, num_layers=2)
        if cls.__name__.startswith("LPPool"):
            kwargs["norm_type"] = 2.0
        if cls.__name__.startswith("FractionalMaxPool"):
            kwargs["output_ratio"] = 0.5
        if cls.__name__ in ("TransformerEncoder",):
            kwargs["encoder_layer"] = nn.TransformerEncoderLayer(8, 2, 16)
            kwargs["num_layers"] = 2
        if cls.__name__ in ("TransformerDecoder",):
            kwargs["decoder_layer"] = nn.TransformerDecoderLayer(8, 2, 16)
            kwargs["num_layers"] = 2
        if cls.__name__ == "Transformer":
            kwargs.update(d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=16)
        if cls.__name__ == "AdaptiveLogSoftmaxWithLoss":
            kwargs.update(in_features=8, n_classes=12, cutoffs=[4, 8])
        return kwargs

    names = sorted(n for n in dir(nn) if isinstance(getattr(nn, n), type) and issubclass(getattr(nn, n), nn.Module))
    for name in names:
        if only and name not in only:
            continue
        cls = getattr(nn, name)
        if cls.__module__.startswith("torch.nn.modules.module") or name in ("Module", "Container"):
            continue
        for i, extra in enumerate([{}] + NN_VARIANTS.get(name, [])):
            try:
                kwargs = small_args(cls, extra)
            except Exception as exc:
                def build(exc=exc):
                    raise exc
            else:
                def build(cls=cls, kwargs=kwargs):
                    # Templates (TransformerEncoder's layer) are rebuilt per call from the seed.
                    fresh = dict(kwargs)
                    for k, v in kwargs.items():
                        if isinstance(v, nn.Module):
                            fresh[k] = type(v)(8, 2, 16)
                    return cls(**fresh)
            label = f"torch.nn.{name}" + (f" {extra}" if extra else "")
            yield label, build


# --------------------------------------------------------------------- main


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", default=os.path.dirname(HERE))
    parser.add_argument("--lib", default="torch,diffusers,transformers")
    parser.add_argument("--only", default="", help="comma-separated model types / class names")
    parser.add_argument("--heads", default="base", choices=["base", "all"],
                        help="transformers: base and causal-LM classes, or every auto mapping")
    parser.add_argument("--reverse-every", type=int, default=5, help="reverse-order check on every Nth model")
    parser.add_argument("--eager-limit", type=float, default=20.0)
    parser.add_argument("--limit", type=float, default=60.0)
    parser.add_argument("--budget", type=float, default=0, help="stop after this many seconds (0: none)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    sys.path.insert(0, os.path.abspath(args.repo))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch

    import deferinit

    print(f"sweeping with {os.path.dirname(deferinit.__file__)}", flush=True)
    only = {s for s in args.only.split(",") if s}
    libs = [s for s in args.lib.split(",") if s]
    results = []
    start = time.perf_counter()
    n = 0
    for lib in libs:
        cases = {"torch": lambda: nn_cases(only), "diffusers": lambda: diffusers_cases(only),
                 "transformers": lambda: transformers_cases(args.heads, only)}[lib]()
        for label, build in cases:
            if args.budget and time.perf_counter() - start > args.budget:
                print("budget spent: stopping", flush=True)
                break
            reverse = args.reverse_every > 0 and n % args.reverse_every == 0
            n += 1
            status, detail, seconds = check(build, reverse, args.eager_limit, args.limit)
            results.append(dict(lib=lib, model=label, status=status, detail=detail, seconds=round(seconds, 2),
                                reverse=reverse))
            print(f"{status:9} {label}: {detail} ({seconds:.1f} s)", flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(dict(repo=args.repo, torch=torch.__version__, results=results), f, indent=1)
    print("\nsummary (library: EQUAL DIFFERENT ERROR SKIPPED)")
    for lib in libs:
        counts = {s: sum(1 for r in results if r["lib"] == lib and r["status"] == s)
                  for s in ("EQUAL", "DIFFERENT", "ERROR", "SKIPPED")}
        print(f"  {lib:13} " + " ".join(f"{k}={v}" for k, v in counts.items()))
    for r in results:
        if r["status"] in ("DIFFERENT", "ERROR"):
            print(f"  {r['status']:9} {r['model']}: {r['detail']}")


if __name__ == "__main__":
    main()
