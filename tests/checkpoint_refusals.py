"""The small model, its state dict and the refusal check the hostile-file tests
share (tests/materialize/test_checkpoint_hostile.py, test_checkpoint_untrusted.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from deferinit import CheckpointError, deferred_init, graph_of
from deferinit.materialize import load_checkpoint


def build():
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))


def state_dict():
    g = torch.Generator().manual_seed(3)
    return {k: torch.randn(v.shape, generator=g) for k, v in build().state_dict().items()}


def refused(source, match: str):
    """``load_checkpoint`` raises ``CheckpointError`` matching ``match`` on a
    deferred and on a real module, and changes neither."""
    torch.manual_seed(0)
    deferred = deferred_init(build)
    before = str(graph_of(deferred))
    with pytest.raises(CheckpointError, match=match) as info:
        load_checkpoint(deferred, source)
    assert str(graph_of(deferred)) == before
    real = build()
    values = {k: v.clone() for k, v in real.state_dict().items()}
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(real, source)
    assert all(torch.equal(v, values[k]) for k, v in real.state_dict().items())
    return info.value
