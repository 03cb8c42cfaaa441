"""Messages describe a fake by the device it reports, never by its backend device.

On a build without CUDA a fake made for ``cuda`` keeps its C++ side on CPU
(``deferinit.fake.device.backend_device``); what a user reads in an error
must be the device they asked for.
"""

from __future__ import annotations

import math

import pytest
import torch

from deferinit import DataDependentError, deferred, deferred_init
from deferinit.fake import FakeDataAccessError, FakeTensor, fake_mode
from deferinit.fake.tensor import describe

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="about fakes whose backend this build lacks")


class ScaledRope(torch.nn.Module):
    """Llama-3.1-style scaled rotary frequencies: a Python branch on each value."""

    def __init__(self, dim=8, device=None):
        super().__init__()
        freqs = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=device).float() / dim))
        freqs = freqs * torch.rand(dim // 2, device=device)  # values eager draws: not known ahead
        scaled = []
        for f in freqs:
            scaled.append(f if 2 * math.pi / f < 4 else f / 8)
        self.register_buffer("freqs", torch.stack(scaled))


def test_describe_names_the_reported_device():
    assert "device='cuda:1'" in describe(FakeTensor(torch.empty(2, device="meta"), "cuda:1"))
    assert describe(torch.ones(2)) == "(size=(2,), dtype=torch.float32, device='cpu')"


def test_data_dependent_error_while_recording_names_cuda():
    with pytest.raises(DataDependentError, match=r"device='cuda:0'\) needs its value while recording") as info:
        deferred_init(ScaledRope, device="cuda")
    assert ", device='cpu')" not in str(info.value)


def test_data_dependent_error_after_the_deferral_names_cuda():
    with deferred():
        t = torch.randn(3, device="cuda")
    for read in (lambda: bool(t.sum() > 0), t.numpy, t.tolist):
        with pytest.raises(DataDependentError, match=r"device='cuda:0'") as info:
            read()
        assert ", device='cpu')" not in str(info.value)


def test_fake_data_access_error_names_cuda():
    with fake_mode(fake_cuda=True):
        t = torch.randn(3, device="cuda")
    for read in (t.tolist, t.numpy, lambda: float(t[0])):
        with pytest.raises(FakeDataAccessError, match=r"device='cuda:0'") as info:
            read()
        assert ", device='cpu')" not in str(info.value)


def test_torchtunes_llama3_1_scaled_rope_under_a_cuda_device_context():
    position = pytest.importorskip(
        "torchtune.models.llama3_1._position_embeddings", reason="torchtune is not installed or not importable",
    )
    with pytest.raises(DataDependentError, match=r"device='cuda:0'") as info:
        with torch.device("cuda"), deferred():
            position.Llama3ScaledRoPE(dim=16, max_seq_len=32)
    assert ", device='cpu')" not in str(info.value)
