"""Reading files inside a fake mode (issue 20): safetensors, storages, buffers, files.

Eagerly these give tensors over memory that exists; inside ``deferred()``
(and ``fake_mode``) they give the same real tensors, as ``torch.load``
already did.  Before ``fake/reads.py`` safetensors' ``load_file`` and
``safe_open(...).get_tensor`` raised "could not determine the shape of
object type 'torch.storage.UntypedStorage'".  Reference: the same calls
made eagerly, and safetensors' own result.
"""

from __future__ import annotations

import pytest
import torch

from deferinit import deferred, is_deferred
from deferinit.fake import fake_mode, is_fake
from deferinit.materialize import materialize_module

safetensors_torch = pytest.importorskip("safetensors.torch")
from safetensors import safe_open  # noqa: E402


@pytest.fixture
def files(tmp_path):
    tensors = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([1, 2, 3], dtype=torch.int16)}
    safetensors_torch.save_file(tensors, tmp_path / "x.safetensors")
    (tmp_path / "raw.bin").write_bytes(bytes(range(16)))
    return tmp_path, tensors


READS = {
    "load_file": lambda d: safetensors_torch.load_file(d / "x.safetensors")["a"],
    "safe_open.get_tensor": lambda d: safe_open(str(d / "x.safetensors"), "pt").get_tensor("b"),
    "safe_open.get_slice": lambda d: safe_open(str(d / "x.safetensors"), "pt").get_slice("a")[1:],
    "safetensors.load(bytes)": lambda d: safetensors_torch.load((d / "x.safetensors").read_bytes())["a"],
    "asarray(storage)": lambda d: torch.asarray(
        torch.UntypedStorage.from_file(str(d / "raw.bin"), False, 16), dtype=torch.uint8
    ),
    "asarray(typed storage)": lambda d: torch.asarray(torch.UntypedStorage.from_buffer(b"abcd", dtype=torch.uint8)),
    "from_file": lambda d: torch.from_file(str(d / "raw.bin"), size=4, dtype=torch.int32),
    "frombuffer": lambda d: torch.frombuffer(bytearray(b"abcdefgh"), dtype=torch.int16),
}


@pytest.mark.parametrize("mode", ["deferred", "fake_mode"])
@pytest.mark.parametrize("name", list(READS))
def test_reads_inside_the_block_give_eagers_real_tensor(files, name, mode):
    d, _ = files
    eager = READS[name](d)
    with (deferred() if mode == "deferred" else fake_mode()):
        inside = READS[name](d)
    assert type(inside) is torch.Tensor and not is_fake(inside)
    assert inside.dtype == eager.dtype and torch.equal(inside, eager)


def test_a_constructor_reading_safetensors_equals_eager(files):
    """A module whose constructor reads its weights from a .safetensors file,
    beside layers initialised at random: values and generator as eagerly."""
    d, tensors = files

    class Pretrained(torch.nn.Module):
        def __init__(self):
            super().__init__()
            with safe_open(str(d / "x.safetensors"), "pt") as f:
                self.table = torch.nn.Parameter(f.get_tensor("a"))
            self.head = torch.nn.Linear(3, 2)
            self.scaled = torch.nn.Parameter(self.table * 2)

    torch.manual_seed(0)
    eager = Pretrained()
    after = torch.rand(4)
    torch.manual_seed(0)
    with deferred():
        m = Pretrained()
    assert not is_fake(m.table) and torch.equal(m.table, tensors["a"])
    assert is_deferred(m.head.weight)
    materialize_module(m)
    for name, t in eager.named_parameters():
        assert torch.equal(t, dict(m.named_parameters())[name]), name
    assert torch.equal(torch.rand(4), after)


def test_a_read_onto_a_device_the_fake_layer_stands_for_is_a_fake(files):
    """``torch.asarray(storage, device="cuda")`` on a CPU-only build: read on
    CPU, then moved to the fake CUDA device (a deferred tensor)."""
    d, _ = files
    storage = torch.UntypedStorage.from_file(str(d / "raw.bin"), False, 16)
    with deferred():
        t = torch.asarray(storage, dtype=torch.uint8, device="cuda")
    assert is_deferred(t) and t.device.type == "cuda" and t.shape == (16,)
    holder = torch.nn.Module()
    holder.register_buffer("t", t)
    materialize_module(holder, device="cpu")
    assert torch.equal(holder.t, torch.arange(16, dtype=torch.uint8))
