"""Materialization on CUDA equals eager construction on CUDA (``make gpu-check``).

Every test here skips without a CUDA device. Eager construction under
``torch.device("cuda")`` draws its initial values from the CUDA generator;
a model deferred under the same device context records those draws and
replays them on the GPU, so every parameter and buffer must come out bit
for bit the same, in any order of materialization, with both the CUDA and
the CPU generators left where eager construction left them.

``DEFERINIT_GPU_CHECK_DEVICE=cpu`` runs the same checks on CPU (how they are
tried on a machine without a GPU).
"""

from __future__ import annotations

import os

import pytest
import torch

from deferinit import deferred_init, is_deferred
from helpers import assert_same_tensors, materialize_in_order
from deferinit.materialize import materialize_module

from gpu_models import MODELS, missing_library

DEVICE = torch.device(os.environ.get("DEFERINIT_GPU_CHECK_DEVICE", "cuda"))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _streams() -> tuple[torch.Tensor, torch.Tensor]:
    """What the device's generator and the CPU's draw next."""
    return torch.rand(16, device=DEVICE), torch.rand(16)


def _seed(seed: int = 0) -> None:
    torch.manual_seed(seed)  # seeds every device's default generator


@pytest.mark.parametrize("order", ["module", "reverse"])
@pytest.mark.parametrize("name,library,build", MODELS, ids=[m[0] for m in MODELS])
def test_real_models_equal_eager_on_the_device(name, library, build, order):
    why = missing_library(library)
    if why:
        pytest.skip(why)
    _seed()
    with torch.device(DEVICE):
        eager = build()
    eager_next = _streams()

    _seed()
    with torch.device(DEVICE):
        model = deferred_init(build)
    assert is_deferred(model)
    if order == "module":
        materialize_module(model)
        after = _streams()
        for e, d, which in zip(eager_next, after, (DEVICE.type, "cpu")):
            assert torch.equal(e, d), f"{name}: the {which} generator is not where eager construction left it"
    else:
        torch.rand(3, device=DEVICE)  # the generator moves between deferral and materialization
        materialize_in_order(model, "reverse")
    assert not is_deferred(model)
    for t in list(model.parameters()) + list(model.buffers()):
        assert t.device.type == DEVICE.type, f"{name}: a tensor materialized on {t.device}"
    assert_same_tensors(eager, model)


def test_a_record_made_for_the_device_materializes_there():
    _seed(3)
    eager = torch.nn.Sequential(torch.nn.Linear(64, 32, device=DEVICE), torch.nn.LayerNorm(32, device=DEVICE))
    eager_next = _streams()
    _seed(3)
    model = deferred_init(
        lambda: torch.nn.Sequential(torch.nn.Linear(64, 32, device=DEVICE), torch.nn.LayerNorm(32, device=DEVICE))
    )
    assert model[0].weight.device.type == DEVICE.type  # reported before any memory exists
    materialize_module(model)  # no device=: the recorded one
    assert model[0].weight.device.type == DEVICE.type
    assert_same_tensors(eager, model)
    assert all(torch.equal(a, b) for a, b in zip(eager_next, _streams()))


def test_a_cpu_record_materialized_on_the_device_equals_eager_moved_there():
    _seed(5)
    eager = torch.nn.Linear(48, 24).to(DEVICE)
    _seed(5)
    model = deferred_init(torch.nn.Linear, 48, 24)
    materialize_module(model, device=DEVICE)
    assert model.weight.device.type == DEVICE.type
    assert_same_tensors(eager, model)


@pytest.mark.skipif(DEVICE.type != "cuda" or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_fsdp2_on_two_nccl_ranks_equals_eager_slices():
    from gpu_workers import case_fsdp2_cuda
    from multiproc import run_ranks

    results = run_ranks(case_fsdp2_cuda, 2, backend="nccl", timeout=300)
    assert [r["params"] for r in results] == [results[0]["params"]] * 2
