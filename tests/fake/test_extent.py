"""extent: the storage a strided tensor needs, as PyTorch itself counts it."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from deferinit.fake.extent import extent, extent_of

geometry = st.integers(0, 4).flatmap(
    lambda ndim: st.tuples(
        st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim),
        st.lists(st.integers(0, 7), min_size=ndim, max_size=ndim),  # 0: overlapping (expanded) rows
        st.integers(0, 9),
    )
)


@settings(max_examples=300, deadline=None)
@given(geometry)
def test_extent_is_torchs_count(g):
    size, stride, offset = g
    n = extent(size, stride, offset)
    # empty_strided allocates what PyTorch's computeStorageNbytes says (offset 0).
    assert torch.empty_strided(size, stride).untyped_storage().nbytes() == extent(size, stride) * 4
    # A storage of n elements holds the view; one of n - 1 does not (unless it needs none).
    assert torch.empty(n).as_strided(size, stride, offset).shape == tuple(size)
    if n > 0:
        with pytest.raises(RuntimeError):
            torch.empty(n - 1).as_strided(size, stride, offset)
        # The last element the view reads is the storage's element n - 1.
        view = torch.arange(n).as_strided(size, stride, offset)
        assert int(view.max()) == n - 1
    else:
        assert 0 in size  # only a zero-size tensor needs no storage, whatever its offset


def test_zero_size_convention():
    t = torch.empty(10)[5:5]
    assert t.storage_offset() == 5 and extent_of(t) == 0
    assert torch.empty(0).as_strided(t.size(), t.stride(), t.storage_offset()).numel() == 0


def test_of_a_view():
    base = torch.empty(4, 6)
    view = base[1:3, 2::2]  # rows 1-2, columns 2 and 4: elements 8, 10, 14, 16
    assert extent_of(view) == 2 * 6 + 4 + 1
    assert base.untyped_storage().nbytes() // 4 >= extent_of(view)
    assert extent_of(base.expand(3, 4, 6)) == 24
