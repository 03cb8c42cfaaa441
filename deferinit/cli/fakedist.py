"""Sharding on paper: PyTorch's fake process group, and CUDA's runtime answered on a CPU-only build.

FSDP2 runs its collectives through a process group and orders them with
streams and events of the mesh's device.  ``torch.testing``'s fake process
group (``init_process_group("fake")``) accepts every collective and moves no
data, which is what one rank's plan needs; on a build without CUDA, the
stream, event and device calls FSDP2 makes on ``torch.cuda`` are answered
by ``torch.cpu``'s no-op versions while the plan runs.
"""

from __future__ import annotations

import contextlib

import torch

from deferinit.fake.patch import shared_patch

from .errors import UsageError


class _Stream(torch.cpu.Stream):
    """A CUDA stream that orders nothing (CPU's), with the identity FSDP2 hands
    its stream ops (torch 2.15's ``fsdp::record_grad_output_stream``)."""

    stream_id = 0
    device_index = 0
    device_type = 1  # c10::DeviceType::CUDA


class _Event(torch.cpu.Event):
    """A CUDA event that waits for nothing (CPU's)."""


_CURRENT = _Stream()

# What FSDP2 calls on torch.cuda (through DeviceMesh's device handle), as new
# objects: torch.compile's tables must not see one function under two names.
_CUDA_RUNTIME = {
    "Stream": _Stream,
    "Event": _Event,
    "current_stream": lambda device=None: _CURRENT,
    "stream": lambda stream: torch.cpu.stream(stream),
    "current_device": lambda: 0,
}


@contextlib.contextmanager
def cuda_runtime_on_cpu():
    """``torch.cuda``'s stream, event and device calls answered by ``torch.cpu``'s,
    where this build has no CUDA (process-wide while the block runs)."""
    if torch.cuda.is_available():
        yield
        return
    with _CUDA_ON_CPU.held():
        yield


# Listed in deferinit.fake.replaced ("cli cuda runtime").
_CUDA_ON_CPU = shared_patch("cli cuda runtime", "torch.cuda", lambda: torch.cuda, lambda _: dict(_CUDA_RUNTIME))


@contextlib.contextmanager
def fake_ranks(world_size: int, rank: int, device_type: str):
    """A 1-D device mesh of ``world_size`` fake ranks, this process being ``rank``.

    Example::

        >>> with fake_ranks(8, 0, "cuda") as mesh:
        ...     fully_shard(model, mesh=mesh)
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_available():
        raise UsageError("--shard needs torch.distributed, which this PyTorch build lacks")
    if dist.is_initialized():
        raise UsageError("--shard needs its own (fake) process group, and one is already initialized")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        with cuda_runtime_on_cpu() if device_type == "cuda" else contextlib.nullcontext():
            yield init_device_mesh(device_type, (world_size,))
    finally:
        dist.destroy_process_group()
