"""A real draw after a deferral whose own draws from that generator are pending (issue 20).

Eagerly the model's draws come first; after ``deferred()`` the generator is
where it was before the block, so a real draw then (PEFT's
``get_peft_model`` on a deferred base, a new head, ``torch.randn``) cannot
equal eager.  It warns, once per deferral, naming the op, the module being
built and the fix.  The reference is eager PyTorch: the values differ
exactly in these cases, and are equal in the others.
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
import torch.nn as nn

from deferinit import PendingDrawsWarning, deferred, deferred_init, pending
from fake import fake_mode
from materialize import materialize_module


def _pending(record_warnings):
    return [w for w in record_warnings if issubclass(w.category, PendingDrawsWarning)]


def _build_then(after, *, materialize_first=False):
    """(eager, deferred) values of ``after()`` following a Linear(4, 4) built eagerly / deferred."""
    torch.manual_seed(0)
    nn.Linear(4, 4)
    eager = after()
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with deferred():
            m = nn.Linear(4, 4)
        if materialize_first:
            materialize_module(m)
        got = after()
        materialize_module(m)
    return eager, got, _pending(seen)


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 2)


@pytest.mark.parametrize(
    "after",
    [
        lambda: Head().proj.weight.detach(),
        lambda: torch.randn(3),
        lambda: torch.empty(3).uniform_(),
        lambda: torch.randint(0, 100, (3,)),
        lambda: torch.bernoulli(torch.full((5,), 0.5)),
    ],
    ids=["module", "randn", "uniform_", "randint", "bernoulli"],
)
def test_a_real_draw_while_draws_are_pending_warns_and_differs_from_eager(after):
    eager, got, seen = _build_then(after)
    assert not torch.equal(eager, got)  # why it warns: eagerly the model drew first
    assert len(seen) == 1
    message = str(seen[0].message)
    assert "default cpu generator" in message and "still deferred" in message
    assert "with deferred()" in message and "materialize_module" in message


def test_the_warning_names_the_module_built_and_the_deferral():
    with deferred():
        nn.Linear(2, 2)
        keep = nn.Linear(2, 2)
    with pytest.warns(PendingDrawsWarning) as seen:
        Head()
    message = str(seen[0].message)
    assert "constructing Head > Linear" in message and "deferred() at test_pending.py" in message
    assert "Tensor.uniform_" in message and "4 random draw(s)" in message
    del keep


@pytest.mark.parametrize("case", ["materialized first", "reseeded", "explicit generator"])
def test_no_warning_where_the_draw_equals_eager(case):
    def after():
        if case == "reseeded":
            torch.manual_seed(7)
        if case == "explicit generator":
            return torch.rand(3, generator=torch.Generator().manual_seed(1))
        return torch.rand(3)

    eager, got, seen = _build_then(after, materialize_first=case == "materialized first")
    assert not seen and torch.equal(eager, got)


def test_no_warning_for_draws_that_are_not_real():
    """Draws inside another deferral are recorded, and draws in fake_mode make fakes."""
    with deferred():
        m = nn.Linear(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PendingDrawsWarning)
        with deferred():
            other = nn.Linear(4, 4)
        with fake_mode():
            nn.Linear(4, 4)
            torch.randn(3)
    materialize_module(m)
    materialize_module(other)


def test_once_per_deferral_and_gone_with_the_record():
    users = pending.PATCHES[0].users
    with deferred():
        m = nn.Linear(2, 2)
    assert pending.PATCHES[0].users == users + 1  # diverted while the record lives
    assert torch.Tensor.uniform_ is not torch._C.TensorBase.uniform_
    with pytest.warns(PendingDrawsWarning):
        torch.rand(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.rand(2)  # the generator moved: nothing is pending for this deferral any more
    del m
    gc.collect()
    assert pending.PATCHES[0].users == users
    if users == 0:
        assert "uniform_" not in vars(torch.Tensor) and torch.rand is torch._C._VariableFunctions.rand


def test_reseeding_to_the_same_seed_is_not_a_pending_draw():
    """A seed set since the deferral: eagerly it resets the generator too."""
    torch.manual_seed(0)
    with deferred():
        m = nn.Linear(2, 2)
    torch.manual_seed(0)  # the very state the deferral left
    with warnings.catch_warnings():
        warnings.simplefilter("error", PendingDrawsWarning)
        torch.rand(2)
    del m


def test_materialization_itself_does_not_warn():
    """Replay draws (trunc_normal_ re-run as a Python call included) never warn."""

    class Init(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(8, 8))
            nn.init.trunc_normal_(self.w)
            self.l = nn.Linear(8, 8)

    torch.manual_seed(0)
    eager = Init()
    torch.manual_seed(0)
    m = deferred_init(Init)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        materialize_module(m)
    assert torch.equal(m.w, eager.w) and torch.equal(m.l.weight, eager.l.weight)


def test_a_draw_eager_refuses_raises_eagers_error():
    """The check never stands in the way: arguments eager refuses get eager's error."""
    with deferred():
        m = nn.Linear(2, 2)
    for call in (lambda f: f(3, device="no-such-device"), lambda f: f(-1), lambda f: f(2, generator=3)):
        with pytest.raises(Exception) as eager:
            call(torch._C._VariableFunctions.randn)
        with warnings.catch_warnings():
            warnings.simplefilter("error", PendingDrawsWarning)  # nothing was drawn: no warning
            with pytest.raises(type(eager.value)) as ours:
                call(torch.randn)
        assert str(ours.value) == str(eager.value)
    with pytest.warns(PendingDrawsWarning):  # the first real draw still says it
        torch.randn(2)
    del m


def test_recording_while_the_draws_are_diverted_equals_eager():
    """A second deferral recorded while the first one's draws are pending (the
    random methods of torch.Tensor diverted): both equal eager, in order."""

    def build():
        return nn.Sequential(nn.Linear(4, 4), nn.Embedding(5, 3))

    torch.manual_seed(0)
    first, second = build(), nn.Conv2d(2, 2, 3)
    eager_next = torch.rand(4)
    torch.manual_seed(0)
    with deferred():
        d_first = build()
    assert torch.Tensor.uniform_ is not torch._C.TensorBase.uniform_
    with deferred():
        d_second = nn.Conv2d(2, 2, 3)
    materialize_module(d_first)
    materialize_module(d_second)
    for a, b in ((first, d_first), (second, d_second)):
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert torch.equal(torch.rand(4), eager_next)
