"""Arguments eager PyTorch rejects at the call are rejected at the call while
recording too, with eager's exception type and message (issue 11, item 16),
on the fast path of deferred_init (``fill_``, ``normal_``, ``uniform_``) and
on the dispatch path (fake_mode, every other op); and what eager accepts stays
accepted, with eager's values."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from deferinit import deferred_init
from deferinit.fake import fake_mode
from helpers import check_exact

REJECTED = {
    "normal_ on expanded": lambda: torch.empty(3).expand(2, 3).normal_(),
    "nn.init.normal_ on expanded": lambda: nn.init.normal_(torch.empty(3).expand(2, 3)),
    "uniform_ on expanded": lambda: torch.empty(3).expand(2, 3).uniform_(),
    "add_ on expanded": lambda: torch.zeros(3).expand(2, 3).add_(1),
    "copy_ into expanded": lambda: torch.zeros(3).expand(2, 3).copy_(torch.ones(2, 3)),
    "copy_ into expanded from an alias": lambda: (lambda t: t.as_strided((2,), (0,)).copy_(t[0, 1:]))(torch.zeros(1, 3)),
    "bernoulli_ on expanded": lambda: torch.empty(1, 3).expand(2, 3).bernoulli_(0.5),
    "uniform_ half from out of range": lambda: torch.empty(3, dtype=torch.half).uniform_(-1e6, 1e6),
    "uniform_ half to out of range": lambda: torch.empty(3, dtype=torch.half).uniform_(0.0, 70000.0),
    "uniform_ half to - from overflows": lambda: torch.empty(3, dtype=torch.half).uniform_(-65504.0, 65504.0),
    "uniform_ to inf": lambda: torch.empty(3).uniform_(0.0, float("inf")),
    "uniform_ from > to": lambda: torch.empty(3).uniform_(2.0, 1.0),
    "uniform_ on int64": lambda: torch.empty(3, dtype=torch.int64).uniform_(),
    "normal_ std<0": lambda: torch.empty(3).normal_(0.0, -1.0),
    "normal_ on int64": lambda: torch.empty(3, dtype=torch.int64).normal_(),
    "bernoulli_(1.5)": lambda: torch.empty(3).bernoulli_(1.5),
    "bernoulli_(-0.1)": lambda: torch.empty(3).bernoulli_(-0.1),
    "bernoulli_(1.5) on empty": lambda: torch.empty(0).bernoulli_(1.5),
    "exponential_(-1)": lambda: torch.empty(3).exponential_(-1.0),
    "exponential_(0)": lambda: torch.empty(3).exponential_(0.0),
    "exponential_ on int64": lambda: torch.empty(3, dtype=torch.int64).exponential_(),
    "geometric_(0)": lambda: torch.empty(3).geometric_(0),
    "geometric_(1.5)": lambda: torch.empty(3).geometric_(1.5),
    "geometric_(1.0)": lambda: torch.empty(3).geometric_(1.0),
    "log_normal_ std<0": lambda: torch.empty(3).log_normal_(0.0, -1.0),
    "cauchy_ sigma<0": lambda: torch.empty(3).cauchy_(0.0, -1.0),
    "random_(5, 2)": lambda: torch.empty(3).random_(5, 2),
    "random_(5, 2) on empty": lambda: torch.empty(0).random_(5, 2),
    "random_(0, 1000) int8": lambda: torch.empty(3, dtype=torch.int8).random_(0, 1000),
    "random_(0, 3) bool": lambda: torch.empty(3, dtype=torch.bool).random_(0, 3),
    "randint(5, 2)": lambda: torch.randint(5, 2, (3,)),
    "randint(0, 1000) int8": lambda: torch.randint(0, 1000, (3,), dtype=torch.int8),
    "rand int64": lambda: torch.rand(3, dtype=torch.int64),
    "randn int64": lambda: torch.randn(3, dtype=torch.int64),
    "randperm(1000) int8": lambda: torch.randperm(1000, dtype=torch.int8),
    "fill_(1000) int8": lambda: torch.empty(3, dtype=torch.int8).fill_(1000),
    "fill_(1000) int8 empty": lambda: torch.empty(0, dtype=torch.int8).fill_(1000),
    "fill_(1e6) half": lambda: torch.empty(3, dtype=torch.half).fill_(1e6),
    "nn.init.constant_(1000) int8": lambda: nn.init.constant_(torch.empty(3, dtype=torch.int8), 1000),
    "full(1000) int8": lambda: torch.full((3,), 1000, dtype=torch.int8),
    "full_like(1000) int8": lambda: torch.full_like(torch.empty(3, dtype=torch.int8), 1000),
    "new_full(1000) int8": lambda: torch.empty(3, dtype=torch.int8).new_full((2,), 1000),
    "masked_fill_(1000) int8": lambda: torch.zeros(3, dtype=torch.int8).masked_fill_(torch.ones(3, dtype=torch.bool), 1000),
    "index_fill_(1000) int8": lambda: torch.zeros(3, dtype=torch.int8).index_fill_(0, torch.tensor([0]), 1000),
    "fill_diagonal_(1000) int8": lambda: torch.zeros(3, 3, dtype=torch.int8).fill_diagonal_(1000),
    "clamp_(max=1000) int8": lambda: torch.zeros(3, dtype=torch.int8).clamp_(max=1000),
    "clamp(max=1e6) half": lambda: torch.zeros(3, dtype=torch.half).clamp(max=1e6),
}


def _raised(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the exception is what is compared
        return e
    return None


@pytest.mark.parametrize("name", list(REJECTED))
def test_rejected_while_recording_with_eagers_error(name):
    fn = REJECTED[name]
    eager = _raised(fn)
    if eager is None:
        # This torch accepts it (2.15 saturates clamp_'s out-of-range int8
        # bound): accepted as eagerly, values included.
        _check_accepted(fn)
        return

    class Catches(nn.Module):
        def __init__(self):
            super().__init__()
            self.caught = _raised(fn)
            self.w = nn.Parameter(torch.randn(3))

    eager_module, deferred = check_exact(Catches)
    for caught in (deferred.caught, _in_fake_mode(fn)):
        assert type(caught) is type(eager), f"eager raised {eager!r}, got {caught!r}"
        assert str(caught) == str(eager)


def _in_fake_mode(fn):
    with fake_mode():
        return _raised(fn)


ACCEPTED = {
    "uniform_ half within range": lambda: torch.empty(3, dtype=torch.half).uniform_(-30000.0, 30000.0),
    "fill_(-1) uint8 wraps": lambda: torch.empty(3, dtype=torch.uint8).fill_(-1),
    "fill_(1e6) on one half element": lambda: torch.empty(1, dtype=torch.half).fill_(1e6),
    "full((1,), 1e6) half": lambda: torch.full((1,), 1e6, dtype=torch.half),
    "fill_ on expanded": lambda: torch.empty(3).expand(2, 3).fill_(2.0),
    "zero_ on expanded": lambda: torch.empty(3).expand(2, 3).zero_(),
    # Geometry-only in-place ops write no elements: no overlap check eagerly.
    "as_strided_ of an expanded view": lambda: torch.randn(2, 4).as_strided((3,), (0,)).as_strided_((3,), (1,)),
    "t_ on expanded": lambda: torch.randn(3).expand(2, 3).t_(),
    "unsqueeze_ on expanded": lambda: torch.randn(3).expand(2, 3).unsqueeze_(0),
    "resize_ of an expanded view": lambda: torch.randn(4)[:1].expand(3).resize_(4),
    # copy_ of a tensor into itself returns early eagerly, overlap or not.
    "copy_ of an expanded view into itself": lambda: (lambda t: t.copy_(t))(torch.randn(1, 3).as_strided((2,), (0,))),
    "bernoulli_(1.0)": lambda: torch.empty(3).bernoulli_(1.0),
    "geometric_(0.5)": lambda: torch.empty(3).geometric_(0.5),
    "random_(0, 128) int8": lambda: torch.empty(3, dtype=torch.int8).random_(0, 128),
    "random_(0, 2) bool": lambda: torch.empty(3, dtype=torch.bool).random_(0, 2),
    "randint(0, 128) int8": lambda: torch.randint(0, 128, (3,), dtype=torch.int8),
    "randperm(128) int8": lambda: torch.randperm(128, dtype=torch.int8),
    "fill_(127) int8": lambda: torch.empty(3, dtype=torch.int8).fill_(127),
    "masked_fill_(-inf)": lambda: torch.zeros(2, 2).masked_fill_(torch.tensor([[True, False], [False, True]]), float("-inf")),
    "clamp_(max=1000) int32": lambda: torch.arange(3, dtype=torch.int32).clamp_(max=1000),
    "normal_ on a strided view": lambda: torch.empty(4, 4)[::2].normal_(),
    "arange int8": lambda: torch.arange(0, 100, dtype=torch.int8),
}


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_accepted_as_eagerly(name):
    _check_accepted(ACCEPTED[name])


def _check_accepted(fn):
    class Accepts(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("b", fn().contiguous())
            self.w = nn.Parameter(torch.randn(3))

    check_exact(Accepts)


def test_explicit_generators_are_not_drawn_by_the_checks():
    g = torch.Generator().manual_seed(3)
    before = g.get_state()
    deferred_init(lambda: torch.empty(5).normal_(generator=g).uniform_(generator=g).random_(0, 9, generator=g))
    assert torch.equal(g.get_state(), before)


def test_checks_never_draw_from_the_default_generator():
    """Random checks run eager kernels: always on a private generator (randn's
    default overload goes through randn.generator)."""
    from deferinit.fake import checks as fake_checks

    calls = [
        lambda: torch.randn(3), lambda: torch.rand(2, 2), lambda: torch.randint(0, 5, (3,)),
        lambda: torch.randint(9, (3,)), lambda: torch.randperm(7), lambda: torch.empty(3).normal_(),
        lambda: torch.empty(3).random_(0, 4), lambda: torch.rand_like(torch.empty(2)),
        lambda: torch.bernoulli(torch.full((3,), 0.5)), lambda: torch.empty(1, 3).expand(2, 3).bernoulli_(),
    ]
    for call in calls:
        fake_checks._passed.clear()  # not answered from the cache
        before = torch.default_generator.get_state()
        try:
            deferred_init(call)
        except RuntimeError:
            pass
        with fake_mode():
            try:
                call()
            except RuntimeError:
                pass
        assert torch.equal(torch.default_generator.get_state(), before)
