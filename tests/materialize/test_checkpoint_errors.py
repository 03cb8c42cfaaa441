"""The errors of load_checkpoint (docs/errors.md): what their messages name, that
nothing is recorded or changed, and that the fix they suggest works.

At call time a bad source raises ``CheckpointError`` and a source that does
not fit the module ``CheckpointMismatchError``, before anything is recorded.
While materializing, a checkpoint that is gone, truncated or changed raises
``CheckpointReadError`` (a ``MaterializationError``) before any tensor is
swapped in: every tensor stays deferred and the generator is untouched.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

from deferinit import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointReadError,
    DeferredInitError,
    MaterializationError,
    deferred_init,
    graph_of,
    is_deferred,
)
from deferinit.fake import fake_mode
from deferinit.materialize import load_checkpoint, materialize_module, materialize_tensor


def build():
    return nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))


@pytest.fixture
def ckpt(tmp_path):
    torch.manual_seed(9)
    sd = build().state_dict()
    path = tmp_path / "model.safetensors"
    save_file(sd, path)
    return path, sd


def test_hierarchy():
    assert issubclass(CheckpointMismatchError, CheckpointError)
    assert issubclass(CheckpointNotFoundError, CheckpointError) and issubclass(CheckpointNotFoundError, FileNotFoundError)
    assert issubclass(CheckpointError, DeferredInitError) and not issubclass(CheckpointError, MaterializationError)
    assert issubclass(CheckpointReadError, MaterializationError)


# -- at call time ---------------------------------------------------------------


def test_missing_path(tmp_path):
    m = deferred_init(build)
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint at .*nothing.safetensors") as info:
        load_checkpoint(m, tmp_path / "nothing.safetensors")
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, CheckpointError)
    with pytest.raises(CheckpointError, match="holds no \\*.safetensors"):
        load_checkpoint(m, tmp_path)


@pytest.mark.parametrize("content", [b"", b"\x05\x00\x00\x00\x00\x00\x00\x00{bad}", b"\xff" * 64], ids=["empty", "json", "size"])
def test_corrupt_safetensors_header(tmp_path, content):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    m = deferred_init(build)
    before = str(graph_of(m))
    with pytest.raises(CheckpointError, match="bad.safetensors"):
        load_checkpoint(m, path)
    assert str(graph_of(m)) == before


def test_not_a_checkpoint(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    with pytest.raises(CheckpointError, match="neither a safetensors file nor a torch.save file"):
        load_checkpoint(deferred_init(build), path)


def test_truncated_file_is_refused_at_call_time(ckpt):
    path, _ = ckpt
    os.truncate(path, os.path.getsize(path) - 100)
    with pytest.raises(CheckpointError, match=r"is not a valid safetensors file: it is truncated: its tensors end at byte \d+, the file has"):
        load_checkpoint(deferred_init(build), path)


def test_plain_fakes_and_meta_tensors_are_refused(ckpt):
    path, _ = ckpt
    with fake_mode():
        fake = build()
    with pytest.raises(CheckpointError, match="fake tensor from fake_mode"):
        load_checkpoint(fake, path)
    with torch.device("meta"):
        meta = build()
    with pytest.raises(CheckpointError, match="meta device.*to_empty"):
        load_checkpoint(meta, path)


def test_view_of_a_materialized_storage_is_refused(ckpt):
    path, sd = ckpt

    class Views(nn.Module):
        def __init__(self):
            super().__init__()
            w = torch.zeros(16, 8)
            self.register_buffer("a", w)
            self.register_buffer("b", w[:2])

    m = deferred_init(Views)
    materialize_tensor(m.a)
    with pytest.raises(CheckpointError, match="cannot load b: .*already materialized"):
        load_checkpoint(m, {"b": torch.ones(2, 8)}, strict=False)
    assert is_deferred(m.b)


def test_mismatch_names_key_shapes_and_file(ckpt):
    path, _ = ckpt
    m = deferred_init(lambda: nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 5)))
    with pytest.raises(CheckpointMismatchError) as info:
        load_checkpoint(m, path)
    message = str(info.value)
    assert "size mismatch for 1.weight" in message and "[4, 16]" in message and "[5, 16]" in message
    assert str(path) in message and "Nothing was loaded or recorded" in message


# -- while materializing ----------------------------------------------------------


def _deferred_loaded(path):
    torch.manual_seed(0)
    m = deferred_init(build)
    load_checkpoint(m, path)
    return m


def _check_untouched(m, state):
    assert all(is_deferred(t) for t in m.parameters())
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("damage", ["truncate", "delete", "reshape"])
def test_damaged_file_leaves_every_tensor_deferred_and_the_fix_works(ckpt, damage, tmp_path):
    path, sd = ckpt
    good = tmp_path / "good.safetensors"
    shutil.copy(path, good)
    m = _deferred_loaded(path)
    if damage == "truncate":
        os.truncate(path, os.path.getsize(path) // 2)
        expected = r"it is truncated: its tensors end at byte"
    elif damage == "delete":
        os.remove(path)
        expected = "No such file or directory"
    else:
        save_file({k: v.reshape(-1) for k, v in sd.items()}, path)
        expected = "changed since load_checkpoint read it: '0.weight' was \\[16, 8\\]"
    state = torch.get_rng_state()
    with pytest.raises(CheckpointReadError, match=expected) as info:
        materialize_module(m)
    assert str(path) in str(info.value) and "Nothing was changed" in str(info.value)
    _check_untouched(m, state)
    shutil.copy(good, path)  # the fix: the file as it was
    materialize_module(m)
    for k, v in m.state_dict().items():
        assert torch.equal(v, sd[k])


def test_an_identical_copy_of_the_file_is_fine(ckpt):
    path, sd = ckpt
    m = _deferred_loaded(path)
    save_file(sd, path)  # a new file (new inode, new time), the same header
    materialize_module(m)
    for k, v in m.state_dict().items():
        assert torch.equal(v, sd[k])


def test_state_dict_tensor_modified_in_place(ckpt):
    _, sd = ckpt
    sd = {k: v.clone() for k, v in sd.items()}
    torch.manual_seed(0)
    m = deferred_init(build)
    load_checkpoint(m, sd)
    sd["1.bias"].add_(1)
    state = torch.get_rng_state()
    with pytest.raises(CheckpointReadError, match="'1.bias' was modified in place since load_checkpoint.*pass a clone"):
        materialize_module(m)
    _check_untouched(m, state)


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def test_the_prefix_hint_counts_missing_keys_only():
    """A checkpoint of 'model.' + every key, plus an unprefixed copy of a tied
    weight: the tie then loads and is not missing, and the hint counts the
    missing keys it explains (6 of the 6), not the checkpoint's prefixed keys
    (it said "8 of the 6")."""
    torch.manual_seed(0)
    eager = _Tied()
    sd = {"model." + k: v for k, v in eager.state_dict().items()}
    sd["head.weight"] = eager.head.weight.detach()
    m = deferred_init(_Tied)
    with pytest.raises(CheckpointMismatchError) as info:
        load_checkpoint(m, sd)
    message = str(info.value)
    assert "6 missing keys" in message
    assert "(6 of the 6 missing keys are in it as 'model.' + key): pass prefix='model.'" in message, message
    assert load_checkpoint(m, sd, prefix="model.") == ([], [])
    materialize_module(m)
    assert all(torch.equal(a, b) for a, b in zip(eager.state_dict().values(), m.state_dict().values()))
