"""Replay runs a pointwise op in place on a first input that dies with it
(materialize/reuse.py): the same values as eager, and nothing else's memory written."""

from __future__ import annotations

import torch
import torch.nn as nn

import deferinit.materialize.replay as replay_module
from deferinit import deferred, deferred_init
from deferinit.materialize import materialize_module
from helpers import assert_same_tensors


def _spy(monkeypatch):
    decided = []
    real = replay_module.reusable

    def spy(replay, node, *args):
        result = real(replay, node, *args)
        decided.append((str(node.target), result))
        return result

    monkeypatch.setattr(replay_module, "reusable", spy)
    return decided


class Quantizes(nn.Module):
    """The pointwise chain of a quantization on a weight nothing else holds."""

    def __init__(self):
        super().__init__()
        w = torch.randn(64, 32)
        scale = w.abs().amax(dim=1, keepdim=True) / 127
        self.register_buffer("q", ((w * (1 / scale)).round() + 1).clamp(-128, 127).to(torch.int8))
        self.register_buffer("scale", scale)


def test_a_pointwise_chain_on_a_dead_tensor_runs_in_place(monkeypatch):
    decided = _spy(monkeypatch)
    torch.manual_seed(0)
    eager = Quantizes()
    torch.manual_seed(0)
    d = deferred_init(Quantizes)
    materialize_module(d)
    assert_same_tensors(eager, d)
    in_place = [op for op, ok in decided if ok]
    # amax / 127 reads amax's result for the last time; 1 / scale is
    # reciprocal(scale) * 1, whose product reads the reciprocal for the last
    # time (not scale: a buffer); w * (1/scale) reads w for the last time;
    # round, + 1 and clamp read the result of the step before.
    assert in_place == [
        "aten.div.Tensor", "aten.mul.Tensor", "aten.mul.Tensor", "aten.round.default", "aten.add.Tensor",
        "aten.clamp.default",
    ], decided


class ReadsLater(nn.Module):
    """Inputs that live on after the op: a value read again, a view's base read
    again, a buffer (a result of the materialization), a tensor from outside
    and a view of it."""

    def __init__(self, outside):
        super().__init__()
        a = torch.randn(16)
        b = a * 2
        self.register_buffer("again", a + b)  # a read after a * 2
        base = torch.randn(4, 4)
        view = base.view(16)
        v2 = view * 3
        self.register_buffer("base_after", base.sum() + v2)  # base read after view * 3
        s = torch.randn(16)
        half = s[:8]
        self.register_buffer("doubled", s * 2)  # s's last read, but its slice is read after
        self.register_buffer("half_plus", half + 1)
        self.register_buffer("kept", torch.randn(8))
        self.register_buffer("from_kept", self.kept * 5)  # kept is a result
        self.register_buffer("from_outside", outside * 7)
        self.register_buffer("from_outside_view", outside.view(2, 4) * 11)


def test_inputs_that_live_on_are_never_written(monkeypatch):
    decided = _spy(monkeypatch)
    outside = torch.arange(8.0)
    torch.manual_seed(0)
    eager = ReadsLater(outside)
    torch.manual_seed(0)
    d = deferred_init(ReadsLater, outside)
    materialize_module(d)
    assert_same_tensors(eager, d)
    assert torch.equal(outside, torch.arange(8.0))
    # In place: a + b only (a's last read; base.sum() + v2 is not: its first
    # input is 0-dim; half + 1 is not: half covers half its memory).  Never
    # a * 2 (a read again), view * 3 (its base read again), s * 2 (a slice of
    # s is read after), kept * 5 (a result), outside * 7, outside.view(2, 4) * 11.
    in_place = [op for op, ok in decided if ok]
    assert in_place == ["aten.add.Tensor"], decided


def test_dtype_promotion_is_never_run_in_place():
    """bf16 * float32 is float32 out of place; in place it would stay bf16."""

    def build():
        m = nn.Module()
        m.register_buffer("x", torch.randn(8, dtype=torch.bfloat16) * torch.full((8,), 3.0))
        return m

    torch.manual_seed(0)
    eager = build()
    torch.manual_seed(0)
    with deferred():
        d = build()
    materialize_module(d)
    assert d.x.dtype == torch.float32
    assert_same_tensors(eager, d)
