"""``deferinit plan``: one training step of a deferred model, measured on fake devices.

The model is built deferred, then a whole step (forward, loss, backward,
the optimizer's step) runs inside ``fake.fake_mode`` on the device the
model was built for (``cuda`` by default, fake on a machine without one)
under PyTorch's ``MemTracker`` and ``FlopCounterMode`` (see
:mod:`deferinit.cli.step`).  With ``--shard N`` the model is first sharded
with FSDP2 over ``N`` ranks of PyTorch's fake process group and the
figures are one rank's, from ``FSDPMemTracker``.  Nothing is allocated.

Example::

    $ deferinit plan deferinit.demo:Llama --dtype bfloat16 --batch 1x4096 --shard 8
"""

from __future__ import annotations

import contextlib
import inspect as pyinspect
import re
import time

import torch

from fake import fake_mode

from .errors import UsageError
from .fakedist import fake_ranks
from .planreport import format_plan
from .step import measure_step
from .targets import build

OPTIMIZERS = {
    "adamw": lambda params, foreach: torch.optim.AdamW(params, lr=1e-4, foreach=foreach),
    "adam": lambda params, foreach: torch.optim.Adam(params, lr=1e-4, foreach=foreach),
    "sgd": lambda params, foreach: torch.optim.SGD(params, lr=1e-4, momentum=0.9, foreach=foreach),
}


def parse_shape(text: str, what: str) -> tuple[int, ...]:
    """``"1x4096"`` -> ``(1, 4096)``.

    Example::

        >>> parse_shape("2x3x32x32", "--input")
        (2, 3, 32, 32)
    """
    if not re.fullmatch(r"\d+(x\d+)*", text.strip()):
        raise UsageError(f"{what} {text!r}: expected sizes joined by x, e.g. 1x4096")
    return tuple(int(n) for n in text.strip().split("x"))


def parse_input(text: str) -> tuple[tuple[int, ...], torch.dtype | None]:
    """``"2x3x32x32"`` or ``"2x16:int64"``: a shape, and a dtype (None: the model's).

    Example::

        >>> parse_input("2x16:int64")
        ((2, 16), torch.int64)
    """
    shape, _, dtype = text.partition(":")
    if dtype:
        value = getattr(torch, dtype.strip().removeprefix("torch."), None)
        if not isinstance(value, torch.dtype):
            raise UsageError(f"--input {text!r}: {dtype!r} is not a torch dtype (float32, bfloat16, int64...)")
        return parse_shape(shape, "--input"), value
    return parse_shape(shape, "--input"), None


def vocabulary(model: torch.nn.Module) -> int | None:
    """The number of token ids ``model`` takes: its config's ``vocab_size``, else
    the size of its first ``nn.Embedding``."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, int):
        return size
    for m in model.modules():
        if isinstance(m, torch.nn.Embedding):
            return m.num_embeddings
    return None


def make_inputs(model, batch, extra, device):
    """``(args, kwargs, token_ids)`` for one forward pass, made inside the fake mode."""
    args, kwargs, ids = [], {}, None
    if batch is not None:
        if len(batch) != 2:
            raise UsageError(f"--batch takes BATCHxSEQUENCE, e.g. 1x4096 (got {'x'.join(map(str, batch))})")
        vocab = vocabulary(model)
        if vocab is None:
            raise UsageError("--batch makes token ids, and the model has no nn.Embedding nor config.vocab_size; "
                             "use --input SHAPE for other inputs")
        ids = torch.randint(0, vocab, batch, device=device)
        if _accepts(model.forward, "labels"):
            kwargs = {"input_ids": ids, "labels": ids}  # transformers: the model's own loss
        else:
            args.append(ids)
    floating = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype())
    for shape, dtype in extra:
        dtype = dtype or floating
        if dtype.is_floating_point:
            args.append(torch.randn(shape, dtype=dtype, device=device))
        else:
            args.append(torch.zeros(shape, dtype=dtype, device=device))
    return tuple(args), kwargs, ids


def _accepts(fn, name: str) -> bool:
    try:
        return name in pyinspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def shard(model: torch.nn.Module, mesh) -> None:
    """FSDP2 as usually applied: each block of every ``nn.ModuleList`` (the
    decoder layers), then the whole model."""
    from torch.distributed.fsdp import fully_shard

    for module in list(model.modules()):
        if isinstance(module, torch.nn.ModuleList):
            for block in module:
                if any(True for _ in block.parameters()):
                    fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _device(model, fallback) -> torch.device:
    for t in model.parameters():
        return t.device
    return torch.device(fallback)


def plan(opts, out) -> int:
    batch = parse_shape(opts.batch, "--batch") if opts.batch else None
    extra = [parse_input(t) for t in opts.input or ()]
    if batch is None and not extra:
        raise UsageError("plan needs inputs: --batch BxS (token ids) and/or --input SHAPE (repeatable)")
    if opts.shard is not None and opts.shard < 1:
        raise UsageError(f"--shard must be at least 1, got {opts.shard}")
    if opts.rank is not None and (opts.shard is None or not 0 <= opts.rank < opts.shard):
        raise UsageError("--rank R needs --shard N with 0 <= R < N")
    if opts.device is None:
        opts.device = "cuda"
    model, build_seconds, _, call, dtype = build(opts)
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"{call} returned a {type(model).__name__}, not an nn.Module; plan needs a module")
    device = _device(model, opts.device)
    foreach = opts.foreach
    if foreach is None:  # what PyTorch picks for real tensors on that device
        from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

        foreach = device.type in _get_foreach_kernels_supported_devices()
    rank = opts.rank or 0
    t0 = time.perf_counter()
    ranks = fake_ranks(opts.shard, rank, device.type) if opts.shard else contextlib.nullcontext()
    with ranks as mesh, fake_mode(fake_cuda=True):
        model.train()
        if mesh is not None:
            shard(model, mesh)
        args, kwargs, ids = make_inputs(model, batch, extra, device)
        optimizer = OPTIMIZERS[opts.optimizer](model.parameters(), foreach)
        measured = measure_step(model, args, kwargs, optimizer, token_ids=ids, sharded=mesh is not None)
    seconds = time.perf_counter() - t0
    setup = {
        "device": device, "batch": batch, "inputs": extra, "optimizer": type(optimizer).__name__,
        "foreach": foreach, "shard": opts.shard, "rank": rank, "dtype": dtype,
    }
    print(format_plan(model, measured, call=call, setup=setup, seconds=seconds, build_seconds=build_seconds), file=out)
    return 0
