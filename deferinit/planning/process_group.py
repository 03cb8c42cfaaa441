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


class FakeProcessGroupError(RuntimeError):
    """:func:`fake_ranks` cannot start PyTorch's fake process group: this build
    has no ``torch.distributed``, or a process group is already initialized.

    ``needs`` says what was missing, for callers that word it their own way
    (the command line: ``--shard needs ...``).
    """

    def __init__(self, needs: str) -> None:
        super().__init__(f"fake_ranks needs {needs}")
        self.needs = needs


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


# Listed in deferinit.fake.replaced ("planner cuda runtime").
_CUDA_ON_CPU = shared_patch("planner cuda runtime", "torch.cuda", lambda: torch.cuda, lambda _: dict(_CUDA_RUNTIME))


@contextlib.contextmanager
def fake_ranks(world_size: int, rank: int, device_type: str):
    """A 1-D device mesh of ``world_size`` fake ranks, this process being ``rank``.

    The block runs with PyTorch's fake process group initialized (every
    collective accepted, no data moved), and with ``device_type`` ``"cuda"``
    on a build without CUDA, ``torch.cuda``'s stream, event and device calls
    answered by ``torch.cpu``'s; both are undone when it ends.  Raises
    :class:`FakeProcessGroupError` when this PyTorch has no
    ``torch.distributed`` or a process group is already initialized.

    Example (FSDP2 shards a model as rank 1 of 4 would hold it)::

        >>> from torch.distributed.fsdp import fully_shard
        >>> model = torch.nn.Linear(8, 8)
        >>> with fake_ranks(4, 1, "cpu") as mesh:
        ...     _ = fully_shard(model, mesh=mesh)
        ...     model.weight.to_local().shape
        torch.Size([2, 8])
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_available():
        raise FakeProcessGroupError("torch.distributed, which this PyTorch build lacks")
    if dist.is_initialized():
        raise FakeProcessGroupError("its own (fake) process group, and one is already initialized")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        with cuda_runtime_on_cpu() if device_type == "cuda" else contextlib.nullcontext():
            yield init_device_mesh(device_type, (world_size,))
    finally:
        dist.destroy_process_group()
