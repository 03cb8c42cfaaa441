"""The storage of a fake (issue 13): the size real memory would have, shared as
real aliases share theirs, weak-referenceable and resizable, holding no bytes.

Every expectation is computed by running the same program on real CPU
tensors: a fake's storage must report the bytes and the aliasing eager
PyTorch gives.
"""

import gc
import weakref

import pytest
import torch

from deferinit import deferred_init
from deferinit.fake import FakeDataAccessError, FakeStorage, fake_mode


def _programs():
    # Each returns a list of tensors made by one program; run real and fake.
    def views():
        t = torch.ones(4, 6)
        return [t, t[1:], t.t(), t.view(24), t.narrow(1, 2, 3), t.expand(2, 4, 6), t.detach(), t.data]

    def fresh_and_in_place():
        t = torch.zeros(3, 5, dtype=torch.float16)
        u = t.clone()
        v = t.add_(1)
        w = u[::2].mul_(3)
        return [t, u, v, w, t + u]

    def resized():
        t = torch.zeros(4)
        t.resize_(10)
        s = torch.zeros(8)[2:5]
        s.resize_(2)  # shrinking keeps the storage
        return [t, s]

    def reinterpreted():
        t = torch.zeros(4, 4)
        return [t, t.view(torch.int32), t.view(torch.uint8)[3:], torch.as_strided(t, (2, 2), (1, 4), 3)]

    def module():
        torch.manual_seed(0)
        m = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
        return list(m.parameters()) + [m.self_attn.in_proj_weight[:16]]

    return [views, fresh_and_in_place, resized, reinterpreted, module]


@pytest.mark.parametrize("program", _programs(), ids=lambda p: p.__name__)
def test_storage_sizes_and_aliasing_match_eager(program):
    real = program()
    with fake_mode():
        fakes = program()
    assert len(real) == len(fakes)
    for r, f in zip(real, fakes):
        assert type(f.untyped_storage()) is FakeStorage
        assert f.untyped_storage().nbytes() == r.untyped_storage().nbytes()
        assert f.untyped_storage().size() == r.untyped_storage().size()
        assert f.untyped_storage().element_size() == 1
    for i in range(len(real)):
        for j in range(len(real)):
            shares = real[i].untyped_storage().data_ptr() == real[j].untyped_storage().data_ptr()
            assert (fakes[i].untyped_storage() is fakes[j].untyped_storage()) == shares, (i, j)


def test_deferred_tensors_have_storages_too_shared_by_ties():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight
            self.view = self.emb.weight[2:]

    m = deferred_init(Tied)
    assert m.head.weight.untyped_storage() is m.emb.weight.untyped_storage() is m.view.untyped_storage()
    assert m.emb.weight.untyped_storage().nbytes() == 10 * 4 * 4


def test_storage_dies_with_its_last_alias():
    with fake_mode():
        t = torch.ones(8)
        v = t[2:]
    ref = weakref.ref(t.untyped_storage())
    del t
    gc.collect()
    assert ref() is not None  # v still uses it
    del v
    gc.collect()
    assert ref() is None


def test_resize_to_zero_and_back_as_fsdp_does():
    """FSDP2 frees an all-gather buffer with resize_(0) and allocates it again;
    views made before keep computing."""
    real, fake = [], []
    for out, ctx in ((real, None), (fake, fake_mode())):
        with ctx if ctx is not None else torch.no_grad():
            buf = torch.empty(12)
            view = torch.as_strided(buf, (3, 4), (4, 1), 0)
            buf.untyped_storage().resize_(0)
            out.append(buf.untyped_storage().nbytes())
            buf.untyped_storage().resize_(buf.numel() * buf.itemsize)
            out.append(buf.untyped_storage().nbytes())
            out.append(tuple((view * 2).shape))
    assert fake == real


def test_memory_tracker_sees_resizes_of_fake_storages():
    """MemTracker patches UntypedStorage.resize_: a FakeStorage must not hide it."""
    from torch.distributed._tools.mem_tracker import MemTracker

    with fake_mode():
        buf = torch.empty(1024)
        mt = MemTracker()
        with mt:
            buf2 = buf * 2
            before = mt.get_tracker_snapshot()[torch.device("cpu")]["Total"]
            buf2.untyped_storage().resize_(0)
            after = mt.get_tracker_snapshot().get(torch.device("cpu"), {}).get("Total", 0)
    assert before - after == 4096


@pytest.mark.parametrize(
    "access, name",
    [
        (lambda s: s.tolist(), "tolist()"),
        (lambda s: s[0], "__getitem__()"),
        (lambda s: s.__setitem__(0, 1), "__setitem__()"),
        (lambda s: s.data_ptr(), "data_ptr()"),
        (lambda s: s.cpu(), "cpu()"),
        (lambda s: s.copy_(torch.empty(16).untyped_storage()), "copy_()"),
        (lambda s: list(s), "__iter__()"),
        (lambda s: __import__("pickle").dumps(s), "pickling"),
    ],
)
def test_storage_bytes_cannot_be_read_or_written(access, name):
    with fake_mode():
        t = torch.ones(4)
    with pytest.raises(FakeDataAccessError) as info:
        access(t.untyped_storage())
    message = str(info.value)
    assert f"UntypedStorage.{name}" in message and "16 bytes" in message and "materialize" in message


def test_typed_storages_stay_refused_with_a_pointer_to_untyped_storage():
    with fake_mode():
        t = torch.ones(4)
    with pytest.raises(FakeDataAccessError, match="untyped_storage"):
        t._typed_storage()
