"""load_checkpoint does what ``load_state_dict`` does (issue 18, item 2): module
hooks and ``_load_from_state_dict`` overrides, lazy modules, inference tensors,
all or nothing on real modules, and a state dict as if copied at the call.

The reference of every test: eager PyTorch, the same module built under the
same seed, then ``load_state_dict`` of the same tensors (values, missing and
unexpected keys, the errors it raises).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

from deferinit import CheckpointError, CheckpointMismatchError, deferred_init, is_deferred
from helpers import assert_same_tensors, named_tensors
from deferinit.materialize import LoadResult, load_checkpoint, materialize_module

MODES = ["real", "deferred"]


def build_in(mode, fn, *args):
    torch.manual_seed(0)
    return fn(*args) if mode == "real" else deferred_init(fn, *args)


def eager_load(fn, sd, *args, strict=True):
    torch.manual_seed(0)
    m = fn(*args)
    return m, m.load_state_dict(sd, strict=strict)


def done(m):
    materialize_module(m)
    return m


def snapshot(m) -> dict:
    return {k: v.detach().clone() for k, v in named_tensors(m).items()}


def assert_unchanged(m, before: dict) -> None:
    now = named_tensors(m)
    assert now.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(now[k].detach(), v), f"{k} changed"


def conv_bn():
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.Linear(3, 2))


def trained_checkpoint(fn, seed=5) -> dict:
    torch.manual_seed(seed)
    m = fn()
    with torch.no_grad():
        for b in m.buffers():
            b.add_(3)
    sd = m.state_dict()
    for k, v in sd.items():
        sd[k] = v.clone()
    return sd  # an OrderedDict with the modules' _metadata, as state_dict() gives


# -- BatchNorm: _load_from_state_dict fills num_batches_tracked ---------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", ["safetensors", "state_dict"])
def test_batchnorm_checkpoint_without_num_batches_tracked_loads_strictly(mode, fmt, tmp_path):
    sd = {k: v for k, v in trained_checkpoint(conv_bn).items() if not k.endswith("num_batches_tracked")}
    source = sd
    if fmt == "safetensors":
        source = str(tmp_path / "old.safetensors")
        save_file(sd, source)
    eager, result = eager_load(conv_bn, sd)
    m = build_in(mode, conv_bn)
    assert load_checkpoint(m, source, strict=True) == tuple(result) == ([], [])
    assert_same_tensors(eager, done(m))


@pytest.mark.parametrize("mode", MODES)
def test_batchnorm_version_2_state_dict_without_the_key_is_refused_as_eagerly(mode):
    sd = trained_checkpoint(conv_bn)
    sd.pop("1.num_batches_tracked")  # an OrderedDict whose _metadata says version 2
    assert sd._metadata["1"]["version"] == 2
    with pytest.raises(RuntimeError, match="Missing key.*1.num_batches_tracked"):
        eager_load(conv_bn, sd)
    m = build_in(mode, conv_bn)
    with pytest.raises(CheckpointMismatchError, match="'1.num_batches_tracked'"):
        load_checkpoint(m, sd)
    eager, result = eager_load(conv_bn, sd, strict=False)
    assert load_checkpoint(m, sd, strict=False) == tuple(result) == (["1.num_batches_tracked"], [])
    assert_same_tensors(eager, done(m))


# -- hooks -------------------------------------------------------------------------


class Renamed(nn.Module):
    """Old checkpoints call ``proj`` ``fc`` and store its weight transposed."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 3)
        self.register_load_state_dict_pre_hook(Renamed._upgrade)

    @staticmethod
    def _upgrade(module, state_dict, prefix, *args):
        for name in ("weight", "bias"):
            old = prefix + "fc." + name
            if old in state_dict:
                value = state_dict.pop(old)
                state_dict[prefix + "proj." + name] = value.t() if name == "weight" else value


class Scaled(nn.Module):
    """A private pre-hook that computes on the values, a post-hook that edits the keys,
    and a ``_load_from_state_dict`` override that drops a key."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 2)
        self.register_buffer("seen", torch.zeros(()))
        self._register_load_state_dict_pre_hook(self._double)
        self.register_load_state_dict_post_hook(Scaled._forgive)

    def _double(self, state_dict, prefix, *args):
        key = prefix + "a.weight"
        if key in state_dict:
            state_dict[key] = state_dict[key] * 2

    @staticmethod
    def _forgive(module, incompatible):
        # The post-hook reads a loaded value: it sees the checkpoint's, as eagerly.
        module.seen.fill_(float(module.b.bias.detach().sum()))
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k != "b.weight"]

    def _load_from_state_dict(self, state_dict, prefix, *args):
        state_dict.pop(prefix + "legacy", None)
        super()._load_from_state_dict(state_dict, prefix, *args)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", ["safetensors", "state_dict"])
def test_public_pre_hook_renames_and_transposes(mode, fmt, tmp_path):
    torch.manual_seed(3)
    sd = {"fc.weight": torch.randn(4, 3), "fc.bias": torch.randn(3)}
    source = sd
    if fmt == "safetensors":
        source = str(tmp_path / "old.safetensors")
        save_file(sd, source)
    eager, result = eager_load(Renamed, dict(sd))
    m = build_in(mode, Renamed)
    assert load_checkpoint(m, source) == tuple(result) == ([], [])
    assert_same_tensors(eager, done(m))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", ["safetensors", "state_dict"])
def test_private_pre_hook_post_hook_and_override(mode, fmt, tmp_path):
    torch.manual_seed(3)
    sd = {"a.weight": torch.randn(3, 3), "a.bias": torch.randn(3), "b.bias": torch.randn(2), "legacy": torch.ones(1), "seen": torch.zeros(())}
    source = sd
    if fmt == "safetensors":
        source = str(tmp_path / "s.safetensors")
        save_file(sd, source)
    eager, result = eager_load(Scaled, dict(sd))
    assert tuple(result) == ([], [])  # the post-hook forgave b.weight, the override dropped legacy
    m = build_in(mode, Scaled)
    assert load_checkpoint(m, source) == ([], [])
    assert_same_tensors(eager, done(m))
    assert float(m.seen) == float(sd["b.bias"].sum())


def test_a_failure_after_a_hook_read_a_loaded_value_undoes_that_load_too():
    """The post-hook reads b.bias (so its load is written then); the unexpected key
    fails the call afterwards: every tensor is put back as it was."""
    torch.manual_seed(3)
    sd = {"a.weight": torch.randn(3, 3), "a.bias": torch.randn(3), "b.bias": torch.randn(2), "seen": torch.zeros(()), "stray": torch.ones(1)}
    with pytest.raises(RuntimeError, match="Unexpected key.*stray"):
        eager_load(Scaled, dict(sd))
    m = build_in("real", Scaled)
    before = snapshot(m)
    with pytest.raises(CheckpointMismatchError, match="'stray'"):
        load_checkpoint(m, sd)
    assert_unchanged(m, before)


def test_a_hook_that_computes_on_a_file_reads_only_what_it_uses(tmp_path):
    """Views of a stand-in stay unread (the transpose); a computation reads."""
    torch.manual_seed(3)
    sd = {"fc.weight": torch.randn(4, 3), "fc.bias": torch.randn(3)}
    path = str(tmp_path / "old.safetensors")
    save_file(sd, path)
    m = deferred_init(Renamed)
    load_checkpoint(m, path)
    os.remove(path)  # nothing was read at the call: the load needs the file
    with pytest.raises(Exception, match="No such file"):
        materialize_module(m)
    assert is_deferred(m)


class Assign(nn.Linear):
    """An override that assigns the checkpoint's tensor instead of copying it."""

    def _load_from_state_dict(self, state_dict, prefix, *args):
        key = prefix + "weight"
        if key in state_dict:
            self.weight = nn.Parameter(state_dict[key])
        super()._load_from_state_dict(state_dict, prefix, *args)


@pytest.mark.parametrize("mode", MODES)
def test_a_hook_that_assigns_a_file_tensor_is_refused(mode, tmp_path):
    sd = {"weight": torch.ones(3, 2), "bias": torch.ones(3)}
    path = str(tmp_path / "a.safetensors")
    save_file(sd, path)
    m = build_in(mode, Assign, 2, 3)
    weight = m.weight
    with pytest.raises(CheckpointError, match="put the checkpoint's tensor itself.*load_file"):
        load_checkpoint(m, path)
    assert m.weight is weight  # the slot is put back
    # A state dict's tensor can be handed out, as eagerly.
    eager, result = eager_load(Assign, dict(sd), 2, 3)
    m = build_in(mode, Assign, 2, 3)
    assert load_checkpoint(m, dict(sd)) == tuple(result)
    assert_same_tensors(eager, done(m))


# -- lazy modules ------------------------------------------------------------------


LAZY = {
    "LazyLinear": lambda: nn.LazyLinear(3),
    "LazyConv2d": lambda: nn.LazyConv2d(4, 3),
    "LazyBatchNorm1d": lambda: nn.LazyBatchNorm1d(),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(LAZY))
def test_lazy_modules_take_their_shapes_from_the_checkpoint(mode, name, tmp_path):
    make = LAZY[name]
    full = {"LazyLinear": lambda: nn.Linear(5, 3), "LazyConv2d": lambda: nn.Conv2d(2, 4, 3), "LazyBatchNorm1d": lambda: nn.BatchNorm1d(6)}[name]
    sd = trained_checkpoint(full)
    path = str(tmp_path / "lazy.safetensors")
    save_file(sd, path)
    eager, result = eager_load(make, sd)
    m = build_in(mode, make)
    assert load_checkpoint(m, path) == tuple(result)
    assert type(m) is type(eager)
    assert_same_tensors(eager, done(m))


@pytest.mark.parametrize("mode", MODES)
def test_lazy_module_is_left_lazy_when_the_load_fails(mode):
    m = build_in(mode, nn.LazyLinear, 3)
    with pytest.raises(CheckpointMismatchError, match="'bias'"):
        load_checkpoint(m, {"weight": torch.ones(3, 5)})
    assert type(m.weight).__name__ == "UninitializedParameter" and repr(m.weight) == "<UninitializedParameter>"
    assert load_checkpoint(m, {"weight": torch.ones(3, 5), "bias": torch.ones(3)}) == ([], [])
    assert done(m).weight.shape == (3, 5)


# -- inference tensors -------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_inference_tensors_refused_outside_inference_mode_as_eagerly(mode, tmp_path):
    sd = {"weight": torch.ones(2, 2), "bias": torch.ones(2)}
    with torch.inference_mode():
        eager = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        eager.load_state_dict(sd)
    with torch.inference_mode():
        m = build_in(mode, nn.Linear, 2, 2)
    before = snapshot(m) if mode == "real" else None
    path = str(tmp_path / "w.safetensors")
    save_file(sd, path)
    for source in (sd, path):
        with pytest.raises(CheckpointError, match="inference tensor.*inside torch.inference_mode"):
            load_checkpoint(m, source)
    if mode == "real":
        assert_unchanged(m, before)  # eager wrote the values before raising; nothing changed here
    else:
        assert is_deferred(m)
    with torch.inference_mode():
        torch.manual_seed(0)
        eager = nn.Linear(2, 2)
        eager.load_state_dict(sd)
        assert load_checkpoint(m, path) == ([], [])
    assert_same_tensors(eager, done(m))
    assert m.weight.is_inference()


# -- all or nothing on real modules --------------------------------------------------


def test_a_read_error_on_a_later_tensor_leaves_a_real_module_unchanged(tmp_path, monkeypatch):
    torch.manual_seed(1)
    sd = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)).state_dict()
    path = str(tmp_path / "m.safetensors")
    save_file(sd, path)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    before = snapshot(m)
    calls = []
    real_preadv = os.preadv

    def failing(fd, buffers, offset, *rest):
        calls.append(offset)
        if len(calls) > 1:
            raise OSError(5, "Input/output error")
        return real_preadv(fd, buffers, offset, *rest)

    monkeypatch.setattr(os, "preadv", failing)
    with pytest.raises(CheckpointError, match="Input/output error.*as it was"):
        load_checkpoint(m, path)
    assert len(calls) > 1  # the first tensor was read before the failure
    assert_unchanged(m, before)
    monkeypatch.undo()
    load_checkpoint(m, path)
    eager, _ = eager_load(lambda: nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), sd)
    assert_same_tensors(eager, m)


@pytest.mark.parametrize("fail_at", [1, 2, 4])
def test_a_read_error_before_or_after_a_hook_read_a_value_leaves_every_tensor(fail_at, tmp_path, monkeypatch):
    """Scaled's post-hook reads b.bias, so that load is read and written during the
    walk; a failing read then, or in the reads after the walk, puts it all back."""
    torch.manual_seed(3)
    sd = {"a.weight": torch.randn(3, 3), "a.bias": torch.randn(3), "b.bias": torch.randn(2), "seen": torch.zeros(())}
    path = str(tmp_path / "s.safetensors")
    save_file(sd, path)
    m = build_in("real", Scaled)
    before = snapshot(m)
    calls = []
    real_preadv = os.preadv

    def failing(fd, buffers, offset, *rest):
        calls.append(offset)
        if len(calls) == fail_at:
            raise OSError(5, "Input/output error")
        return real_preadv(fd, buffers, offset, *rest)

    monkeypatch.setattr(os, "preadv", failing)
    with pytest.raises(CheckpointError, match="Input/output error") as info:
        load_checkpoint(m, path)
    assert not isinstance(info.value, CheckpointMismatchError)
    assert_unchanged(m, before)


def test_a_file_truncated_after_its_header_was_read_leaves_a_real_module_unchanged(tmp_path, monkeypatch):
    from deferinit.materialize.checkpoint import api

    torch.manual_seed(1)
    sd = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)).state_dict()
    path = str(tmp_path / "m.safetensors")
    save_file(sd, path)
    m = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    before = snapshot(m)
    opened = api.open_source

    def open_then_truncate(source):
        out = opened(source)
        os.truncate(path, os.path.getsize(path) - 8)  # the last tensor loses its end
        return out

    monkeypatch.setattr(api, "open_source", open_then_truncate)
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(m, path)
    assert_unchanged(m, before)


# -- a state dict behaves as if copied at the call ------------------------------------


@pytest.mark.parametrize("change", ["inference_in_place", "data_reassigned"])
def test_state_dict_changed_after_the_call_does_not_change_the_result(change):
    with torch.inference_mode() if change == "inference_in_place" else torch.no_grad():
        sd = {"weight": torch.full((3, 2), 2.0), "bias": torch.full((3,), 3.0)}
    eager, _ = eager_load(nn.Linear, sd, 2, 3)
    m = build_in("deferred", nn.Linear, 2, 3)
    load_checkpoint(m, sd)
    if change == "inference_in_place":
        with torch.inference_mode():
            sd["weight"].add_(100)
    else:
        sd["weight"].data = torch.zeros(3, 2)
    assert_same_tensors(eager, done(m))


def test_state_dict_changed_in_place_after_the_call_is_refused_not_read():
    from deferinit import CheckpointReadError

    sd = {"weight": torch.full((3, 2), 2.0), "bias": torch.full((3,), 3.0)}
    m = build_in("deferred", nn.Linear, 2, 3)
    load_checkpoint(m, sd)
    sd["bias"].mul_(2)
    with pytest.raises(CheckpointReadError, match="'bias' was modified in place"):
        materialize_module(m)
    assert is_deferred(m)
