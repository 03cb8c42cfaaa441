"""NumPy round trips inside deferred_init and fake_mode (issue 11, item 1).

Real tensors stay real: their arrays alias their memory, for reads and
writes, as eagerly (views and ``detach`` of a real tensor are real).  A
deferred tensor's array holds the values eager construction would see,
computed like ``.item()``; it is read-only where it shares that value's
memory, since a write could not reach the record (numpy raises instead of
losing it).  Plain fakes refuse with FakeDataAccessError."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

from deferinit import deferred_init
from deferinit.fake import FakeDataAccessError, fake_mode, is_fake
from helpers import check_exact

READS = {
    "numpy()": lambda t: t.numpy(),
    "np.asarray": np.asarray,
    "numpy(force=True)": lambda t: t.numpy(force=True),
    "np.asarray(dtype=float64)": lambda t: np.asarray(t, dtype=np.float64),
    "np.array (copy)": np.array,
}
SOURCES = {
    "arange": lambda pre: torch.arange(6.0),
    "randn": lambda pre: torch.randn(6),
    "view of randn": lambda pre: torch.randn(4, 6)[1],
    "strided view": lambda pre: torch.randn(12)[::2],
    "after in-place": lambda pre: torch.zeros(6).add_(torch.randn(6)),
    "real from outside": lambda pre: pre,
    "view of real": lambda pre: pre[::1].view(2, 3).view(6),
    "detach of real": lambda pre: pre.detach(),
}


class ReadsThroughNumpy(nn.Module):
    def __init__(self, read, source, pre):
        super().__init__()
        x = source(pre)
        array = read(x)
        self.total = float(array.sum())
        self.register_buffer("b", torch.from_numpy(np.array(array, copy=True) * 2 + 1))
        self.p = nn.Parameter(torch.randn(3))  # a draw after the read


@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize("read", list(READS))
def test_numpy_read_inside_deferred_init(read, source):
    pre = torch.linspace(-1, 1, 6)
    eager, deferred = check_exact(ReadsThroughNumpy, READS[read], SOURCES[source], pre)
    assert deferred.total == eager.total


@pytest.mark.parametrize("read", ["numpy()", "np.asarray", "numpy(force=True)"])
def test_array_of_a_deferred_tensor_refuses_writes(read):
    """The write cannot reach the record: numpy refuses it rather than losing it."""
    seen = {}

    class WritesThroughNumpy(nn.Module):
        def __init__(self):
            super().__init__()
            x = torch.zeros(3)
            array = READS[read](x)
            seen["writeable"] = array.flags.writeable
            try:
                array[0] = 7.0
            except ValueError as e:
                seen["error"] = str(e)
            self.register_buffer("b", x)

    deferred_init(WritesThroughNumpy)
    assert seen == {"writeable": False, "error": "assignment destination is read-only"}


@pytest.mark.parametrize("copy", ["np.asarray(dtype=float64)", "np.array (copy)", "numpy().copy()"])
def test_copies_of_a_deferred_tensor_are_writable_as_eagerly(copy):
    """np.array(t), np.asarray(t, dtype=other) copy eagerly too: writes stay in the copy."""
    copies = {
        "np.asarray(dtype=float64)": lambda t: np.asarray(t, dtype=np.float64),
        "np.array (copy)": np.array,
        "numpy().copy()": lambda t: t.numpy().copy(),
    }

    class WritesCopy(nn.Module):
        def __init__(self):
            super().__init__()
            x = torch.randn(3)
            array = copies[copy](x)
            array[0] = 7.0
            self.register_buffer("b", x)
            self.register_buffer("c", torch.from_numpy(array))

    check_exact(WritesCopy)


@pytest.mark.parametrize("read", ["numpy()", "np.asarray", "view.numpy()", "detach().numpy()"])
def test_real_tensor_array_aliases_its_memory_inside_deferred_init(read):
    pre = torch.arange(4.0)
    seen = {}
    reads = {
        "numpy()": lambda t: t.numpy(),
        "np.asarray": np.asarray,
        "view.numpy()": lambda t: t[:].numpy(),
        "detach().numpy()": lambda t: t.detach().numpy(),
    }

    class WritesOutside(nn.Module):
        def __init__(self):
            super().__init__()
            array = reads[read](pre)
            seen["values"] = array.copy()
            array[1] = 42.0  # writes pre, eagerly
            self.w = nn.Parameter(torch.ones(2))

    deferred_init(WritesOutside)
    assert np.array_equal(seen["values"], np.arange(4.0, dtype=np.float32))
    assert torch.equal(pre, torch.tensor([0.0, 42.0, 2.0, 3.0]))


@pytest.mark.parametrize("read", list(READS))
def test_real_tensors_in_fake_mode_read_as_eagerly(read):
    pre = torch.randn(6)
    expected = np.array(READS[read](pre), copy=True)
    with fake_mode():
        got = np.array(READS[read](pre), copy=True)
        sliced = np.array(READS[read](pre[::2]), copy=True)
    assert np.array_equal(got, expected)
    assert np.array_equal(sliced, np.array(READS[read](pre[::2]), copy=True))


def test_views_of_real_tensors_stay_real_and_aliased_in_fake_mode():
    pre = torch.arange(6.0)
    with fake_mode():
        views = [pre[::2], pre.view(2, 3), pre.detach(), pre.t() if pre.dim() == 2 else pre.unsqueeze(0)]
        for v in views:
            assert not is_fake(v)
        views[0].fill_(-1.0)  # a write through a real view reaches the real tensor
        computed = pre * 2
    assert is_fake(computed)
    assert torch.equal(pre, torch.tensor([-1.0, 1.0, -1.0, 3.0, -1.0, 5.0]))


@pytest.mark.parametrize("read", ["numpy()", "np.asarray"])
def test_plain_fakes_refuse_numpy(read):
    with fake_mode():
        fake = torch.empty(3)  # no value to know (torch.ones' is known: fake.md#known-values)
        for t in (fake, fake + 1, fake[::2]):
            with pytest.raises(FakeDataAccessError, match="numpy"):
                READS[read](t)
