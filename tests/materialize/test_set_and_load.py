"""``set_`` with a source, an offset, a size and strides, and ``torch.load`` /
``pickle`` of real tensors inside a constructor (issue 11, item 15): eager's
values and eager's aliasing."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
import torch.nn as nn

from deferinit import deferred_init, is_deferred
from deferinit.fake import fake_mode, is_fake
from helpers import check_exact

SET_FORMS = {
    "set_(src, 2, (2, 3), (3, 1))": lambda t, src: t.set_(src, 2, (2, 3), (3, 1)),
    "set_(src, 0, (3,), (2,))": lambda t, src: t.set_(src, 0, (3,), (2,)),
    "set_(src, 1, (2, 2)) contiguous": lambda t, src: t.set_(src, 1, (2, 2)),
    "set_(src, 0, (0,))": lambda t, src: t.set_(src, 0, (0,)),
    "set_(source=, storage_offset=, size=, stride=)": lambda t, src: t.set_(source=src, storage_offset=1, size=(4,), stride=(2,)),
    "set_(src[3:], 5, (2,), (1,)) view source": lambda t, src: t.set_(src[3:], 5, (2,), (1,)),
    "set_(src)": lambda t, src: t.set_(src),
    "set_(src.t()) after reshape": lambda t, src: t.set_(src.view(3, 4).t()),
}


class SetSource(nn.Module):
    def __init__(self, how, later_write):
        super().__init__()
        src = torch.randn(12)
        t = SET_FORMS[how](torch.empty(0), src)
        if later_write:
            with torch.no_grad():
                src.mul_(2)  # seen through t: they share memory
        self.register_buffer("t", t)
        self.register_buffer("src", src)
        self.p = nn.Parameter(torch.randn(2))


@pytest.mark.parametrize("later_write", [False, True])
@pytest.mark.parametrize("how", list(SET_FORMS))
def test_set_with_a_source_inside_constructor(how, later_write):
    eager, deferred = check_exact(SetSource, how, later_write)
    assert (deferred.t.stride(), deferred.t.storage_offset()) == (eager.t.stride(), eager.t.storage_offset())
    with torch.no_grad():  # aliasing survives materialization
        deferred.src.add_(1)
        eager.src.add_(1)
    assert torch.equal(deferred.t, eager.t)


def test_set_past_the_source_grows_its_storage_as_eagerly():
    """Eager set_ grows the source's storage when the geometry needs more."""

    class Grows(nn.Module):
        def __init__(self):
            super().__init__()
            src = torch.randn(4)
            t = torch.empty(0).set_(src, 2, (3,), (1,))
            self.register_buffer("head", t[:2].clone())  # the part with defined values
            self.register_buffer("t", t)
            self.register_buffer("src", src)

    eager, deferred = check_exact_geometry(Grows)
    assert deferred.src.untyped_storage().nbytes() == eager.src.untyped_storage().nbytes() == 20
    assert deferred.t.untyped_storage().data_ptr() == deferred.src.untyped_storage().data_ptr()


def check_exact_geometry(ctor):
    """Like check_exact, for a module whose buffer ``t`` holds uninitialized memory."""
    torch.manual_seed(0)
    eager = ctor()
    torch.manual_seed(0)
    deferred = deferred_init(ctor)
    from deferinit.materialize import materialize_module

    materialize_module(deferred)
    assert torch.equal(eager.head, deferred.head) and torch.equal(eager.src[:4], deferred.src[:4])
    assert (eager.t.shape, eager.t.stride(), eager.t.storage_offset()) == (
        deferred.t.shape, deferred.t.stride(), deferred.t.storage_offset())
    return eager, deferred


def _saved(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


LOADS = {
    "torch.load(tensor)": lambda pre: torch.load(_saved(pre)),
    "torch.load(view)": lambda pre: torch.load(_saved(pre[1::2])),
    "torch.load(dict)['b']": lambda pre: torch.load(_saved({"a": pre, "b": pre[::2]}))["b"],
    "torch.load(weights_only=False)": lambda pre: torch.load(_saved(pre), weights_only=False),
    "pickle.loads": lambda pre: pickle.loads(pickle.dumps(pre)),
    "torch.load(Parameter)": lambda pre: torch.load(_saved(PARAMETER), weights_only=False).detach(),
}


PARAMETER = nn.Parameter(torch.ones(3))


@pytest.mark.parametrize("how", list(LOADS))
def test_load_real_tensor_inside_constructor(how):
    pre = torch.linspace(0, 1, 6)
    seen = {}

    class Loads(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3))
            loaded = LOADS[how](pre)
            seen.setdefault("real", []).append(not is_fake(loaded))
            self.register_buffer("b", loaded)
            self.register_buffer("c", loaded * 2 + self.w.detach().sum())
            self.v = nn.Parameter(torch.randn(3))

    check_exact(Loads)
    assert seen["real"] == [True, True]  # loaded tensors are real, as eagerly


def test_loaded_views_alias_each_other_as_eagerly():
    pre = torch.arange(6.0)

    class LoadsViews(nn.Module):
        def __init__(self):
            super().__init__()
            a, b = torch.load(_saved([pre, pre[2:4]]))
            with torch.no_grad():
                a.add_(10)  # b shares a's memory
            self.register_buffer("b", b.clone())
            self.p = nn.Parameter(torch.randn(2))

    eager, deferred = check_exact(LoadsViews)
    assert torch.equal(deferred.b, torch.tensor([12.0, 13.0]))


def test_load_into_a_deferred_buffer_after_deferral():
    """A fake made real by set_ (the fake_mode / post-deferral case)."""
    torch.manual_seed(0)
    m = deferred_init(nn.Linear, 2, 2)
    storage = torch.arange(4.0).untyped_storage()
    fake_bias = m.bias
    m.bias.data.set_(storage, 0, (2,), (1,))
    assert fake_bias is m.bias and is_deferred(m.bias)  # .data is another object
    with fake_mode():
        t = torch.empty(0)
        assert t.set_(storage, 1, (3,), (1,)) is t and not is_fake(t)
    assert torch.equal(t, torch.tensor([1.0, 2.0, 3.0]))


def test_real_storage_on_another_device_fails_as_eager():
    storage = torch.arange(4.0).untyped_storage()
    with pytest.raises(RuntimeError) as eager:
        torch.empty(0, device="meta").set_(storage)
    with pytest.raises(RuntimeError) as deferred:
        deferred_init(lambda: torch.empty(0, device="cuda").set_(storage))
    assert str(deferred.value) == str(eager.value).replace('"meta"', '"cuda:0"')
