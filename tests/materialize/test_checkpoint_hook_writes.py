"""Hooks and ``_load_from_state_dict`` overrides that write during ``load_checkpoint``'s
walk by other means than a ``copy_`` of a whole module tensor: writes into a
slice, ``fill_``, ``add_``, ``.data =``, and writes into a tensor a load was
copied from.  The reference: eager ``load_state_dict`` of the same state dict
on the same module built under the same seed; and, for a call that fails, the
module as it was before the call (values, and a deferred record that still
materializes to eager construction).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

from deferinit import CheckpointMismatchError, deferred_init
from helpers import assert_same_tensors, named_tensors
from deferinit.materialize import load_checkpoint, materialize_module

MODES = ["real", "deferred"]


def build_in(mode, cls):
    torch.manual_seed(0)
    return cls() if mode == "real" else deferred_init(cls)


def eager(cls, sd, strict=True):
    torch.manual_seed(0)
    m = cls()
    return m, m.load_state_dict(dict(sd), strict=strict)


def snapshot(m) -> dict:
    return {k: v.detach().clone() for k, v in named_tensors(m).items()}


class SliceCopy(nn.Module):
    """A converter override: the checkpoint's ``top`` goes into half of ``w``."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 2))
        self.l = nn.Linear(2, 2)

    def _load_from_state_dict(self, state_dict, prefix, *args):
        if prefix + "top" in state_dict:
            with torch.no_grad():
                self.w[:3].copy_(state_dict.pop(prefix + "top"))
        super()._load_from_state_dict(state_dict, prefix, *args)


class Filled(nn.Module):
    """An override that writes a module tensor without reading the checkpoint."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))
        self.l = nn.Linear(2, 2)

    def _load_from_state_dict(self, state_dict, prefix, *args):
        with torch.no_grad():
            self.w.add_(1.0)
        super()._load_from_state_dict(state_dict, prefix, *args)


class DataAssigned(nn.Module):
    """An override that points a parameter at the checkpoint's tensor (``.data =``)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))
        self.l = nn.Linear(2, 2)

    def _load_from_state_dict(self, state_dict, prefix, *args):
        if prefix + "w" in state_dict:
            self.w.data = state_dict.pop(prefix + "w")
        super()._load_from_state_dict(state_dict, prefix, *args)


WRONG = {"l.weight": torch.ones(3, 3), "l.bias": torch.ones(2)}  # a size mismatch


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cls, extra", [(SliceCopy, {"top": torch.full((3, 2), 7.0)}), (Filled, {})])
def test_a_failed_call_puts_back_what_a_hook_wrote(mode, cls, extra):
    with pytest.raises(RuntimeError, match="size mismatch"):
        eager(cls, {**extra, **WRONG}, strict=False)  # eager writes w, then raises
    m = build_in(mode, cls)
    before = snapshot(m) if mode == "real" else None
    with pytest.raises(CheckpointMismatchError, match="size mismatch"):
        load_checkpoint(m, {**extra, **WRONG}, strict=False)
    if mode == "real":
        now = snapshot(m)
        for k, v in before.items():
            assert torch.equal(now[k], v), f"{k} changed by a failed call"
    else:  # the record is as before the call: materialized, it is eager construction
        torch.manual_seed(0)
        reference = cls()
        assert_same_tensors(reference, materialize_module(m))


def test_a_failed_call_puts_back_a_tensor_a_hook_pointed_elsewhere():
    m = build_in("real", DataAssigned)
    before = snapshot(m)
    with pytest.raises(CheckpointMismatchError, match="size mismatch"):
        load_checkpoint(m, {"w": torch.ones(3), **WRONG}, strict=False)
    now = snapshot(m)
    for k, v in before.items():
        assert torch.equal(now[k], v), f"{k} changed by a failed call"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cls, extra", [(SliceCopy, {"top": torch.full((3, 2), 7.0)}), (Filled, {})])
def test_a_hook_that_writes_equals_eager(mode, cls, extra):
    sd = {**extra, "l.weight": torch.full((2, 2), 3.0), "l.bias": torch.ones(2)}
    e, result = eager(cls, sd, strict=False)  # w is missing: the hook wrote it
    m = build_in(mode, cls)
    assert load_checkpoint(m, dict(sd), strict=False) == tuple(result)
    assert_same_tensors(e, materialize_module(m))


class Scratch(nn.Module):
    """A converter pre-hook: one scratch tensor reused for each layer's copy."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(2, 2, bias=False) for _ in range(3))
        self._register_load_state_dict_pre_hook(self._convert)

    def _convert(self, state_dict, prefix, *args):
        stacked = state_dict.pop(prefix + "stacked", None)
        if stacked is None:
            return
        scratch = torch.empty(2, 2)
        for i, layer in enumerate(self.layers):
            scratch.copy_(stacked[i])
            with torch.no_grad():
                layer.weight.copy_(scratch)


class ScaledAfter(nn.Module):
    """An override that copies the given tensor, then changes it in place."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3))

    def _load_from_state_dict(self, state_dict, prefix, *args):
        given = state_dict[prefix + "w"]
        with torch.no_grad():
            self.w.copy_(given)
            given.mul_(10)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", ["state_dict", "safetensors"])
def test_a_tensor_written_after_a_load_copied_it_gives_the_values_it_had(mode, fmt, tmp_path):
    """Eager's copy_ reads its source at the call; so does the load."""
    sd = {"stacked": torch.arange(12.0).reshape(3, 2, 2)}
    e, result = eager(Scratch, sd, strict=False)
    source = dict(sd)
    if fmt == "safetensors":
        source = str(tmp_path / "s.safetensors")
        save_file(sd, source)
    m = build_in(mode, Scratch)
    assert load_checkpoint(m, source, strict=False) == tuple(result)
    assert_same_tensors(e, materialize_module(m))


@pytest.mark.parametrize("mode", MODES)
def test_a_state_dict_tensor_a_hook_changes_after_copying_it(mode):
    e, _ = eager(ScaledAfter, {"w": torch.ones(3)})
    given = torch.ones(3)
    m = build_in(mode, ScaledAfter)
    load_checkpoint(m, {"w": given})
    assert torch.equal(given, torch.full((3,), 10.0))  # as eagerly: the hook's write is the user's
    assert_same_tensors(e, materialize_module(m))


@pytest.mark.parametrize("mode", MODES)
def test_a_tensor_a_hook_loads_under_no_key_of_its_own_is_missing_as_eagerly(mode):
    """Only ties are forgiven (a tied tensor under another of its names): a
    tensor a hook loaded while its own key is absent is missing, as eagerly,
    and strict=True refuses it as load_state_dict does."""
    sd = {"stacked": torch.arange(12.0).reshape(3, 2, 2)}
    with pytest.raises(RuntimeError, match="Missing key"):
        eager(Scratch, sd)
    _, result = eager(Scratch, sd, strict=False)
    m = build_in(mode, Scratch)
    assert load_checkpoint(m, dict(sd), strict=False) == tuple(result)
    m = build_in(mode, Scratch)
    with pytest.raises(CheckpointMismatchError, match="missing key"):
        load_checkpoint(m, dict(sd))


class ReadThenRepoint(nn.Module):
    """A post-hook reads a loaded weight (so it is written during the walk), then
    points it at a tensor of its own."""

    def __init__(self, replacement):
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.replacement = replacement
        self.register_load_state_dict_post_hook(self._post)

    @staticmethod
    def _post(module, incompatible):
        module.total = float(module.a.weight.detach().sum())
        module.a.weight.data = module.replacement


def test_a_failed_call_puts_back_a_loaded_tensor_a_hook_then_pointed_elsewhere():
    replacement = torch.zeros(2, 2)
    torch.manual_seed(0)
    m = ReadThenRepoint(replacement)
    memory = m.a.weight.untyped_storage()._cdata
    before = snapshot(m)
    sd = {"a.weight": torch.ones(2, 2), "a.bias": torch.ones(2), "stray": torch.ones(1)}
    with pytest.raises(CheckpointMismatchError, match="'stray'"):
        load_checkpoint(m, sd)
    assert m.total == 4.0  # the hook saw the loaded values, as eagerly
    now = snapshot(m)
    for k, v in before.items():
        assert torch.equal(now[k], v), f"{k} changed by a failed call"
    assert m.a.weight.untyped_storage()._cdata == memory
    assert torch.equal(replacement, torch.zeros(2, 2))  # the hook's own tensor is not written


# -- file tensors stand in as meta tensors during the walk --------------------------


class KeepsExtra(nn.Module):
    """A pre-hook that keeps a checkpoint tensor as a plain attribute."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(2, 2)
        self.extra = None
        self._register_load_state_dict_pre_hook(self._keep)

    def _keep(self, state_dict, prefix, *args):
        self.extra = state_dict.pop(prefix + "extra", None)


class ViaNumpy(nn.Module):
    """A pre-hook that converts through NumPy (reads values outside dispatch)."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(2, 2)
        self._register_load_state_dict_pre_hook(self._flip)

    def _flip(self, state_dict, prefix, *args):
        w = state_dict[prefix + "l.weight"].numpy()
        state_dict[prefix + "l.weight"] = torch.from_numpy(w[::-1].copy())


SD = {"l.weight": torch.arange(4.0).reshape(2, 2), "l.bias": torch.ones(2)}


@pytest.mark.parametrize("mode", MODES)
def test_a_file_tensor_a_hook_keeps_as_an_attribute_is_refused_and_put_back(mode, tmp_path):
    from deferinit import CheckpointError

    sd = {**SD, "extra": torch.full((3,), 5.0)}
    path = str(tmp_path / "k.safetensors")
    save_file(sd, path)
    m = build_in(mode, KeepsExtra)
    with pytest.raises(CheckpointError, match="extra.*load_file"):
        load_checkpoint(m, path)
    assert m.extra is None
    # A state dict's tensor can be kept, as eagerly.
    e, result = eager(KeepsExtra, sd)
    m = build_in(mode, KeepsExtra)
    assert load_checkpoint(m, dict(sd)) == tuple(result)
    assert torch.equal(m.extra, e.extra)


@pytest.mark.parametrize("mode", MODES)
def test_a_hook_that_needs_real_file_tensors_says_how_to_load(mode, tmp_path):
    """Eager loads it; a file's stand-in has no values outside dispatch (.numpy()):
    the hook's own error stays (its type too) with a note naming the fix."""
    path = str(tmp_path / "n.safetensors")
    save_file(SD, path)
    e, result = eager(ViaNumpy, SD)
    m = build_in(mode, ViaNumpy)
    before = snapshot(m) if mode == "real" else None
    with pytest.raises(TypeError) as info:
        load_checkpoint(m, path)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "ViaNumpy" in notes and "load_file" in notes and "meta" in notes
    if mode == "real":
        assert all(torch.equal(snapshot(m)[k], v) for k, v in before.items())
    from safetensors.torch import load_file

    assert load_checkpoint(m, load_file(path)) == tuple(result)
    assert_same_tensors(e, materialize_module(m))


class BThenA(nn.Module):
    def __init__(self):
        super().__init__()
        self.b = nn.Linear(3, 3)
        self.a = nn.Linear(3, 3)


def test_a_deferred_load_from_a_real_tensor_the_same_call_loads_later_reads_it_as_it_was():
    """Partly materialized: b (deferred) copies a's real weight, then a (real) is
    loaded; eagerly b got a's old values (the walk copies b first)."""
    torch.manual_seed(0)
    e = BThenA()
    e.load_state_dict({"b.weight": e.a.weight.detach(), "a.weight": torch.ones(3, 3)}, strict=False)
    m = build_in("deferred", BThenA)
    materialize_module(m.a)
    assert load_checkpoint(m, {"b.weight": m.a.weight.detach(), "a.weight": torch.ones(3, 3)}, strict=False) == (
        ["b.bias", "a.bias"], [])
    assert_same_tensors(e, materialize_module(m))


class Packed(nn.Module):
    """Two parameters on one flat memory (as packing code lays them out); an
    override writes the second one's elements through the flat memory."""

    def __init__(self):
        super().__init__()
        flat = torch.randn(10)
        self.a = nn.Parameter(flat[:4].view(2, 2))
        self.b = nn.Parameter(flat[4:].view(3, 2))
        self.l = nn.Linear(2, 2)

    def _load_from_state_dict(self, state_dict, prefix, *args):
        if prefix + "flat_b" in state_dict:
            flat = torch.empty(0).set_(self.b.untyped_storage())
            with torch.no_grad():
                flat[4:].copy_(state_dict.pop(prefix + "flat_b"))
        super()._load_from_state_dict(state_dict, prefix, *args)


def test_a_failed_call_puts_back_every_tensor_on_memory_a_hook_wrote():
    m = build_in("real", Packed)
    before = snapshot(m)
    with pytest.raises(CheckpointMismatchError, match="size mismatch"):
        load_checkpoint(m, {"flat_b": torch.full((6,), 9.0), **WRONG}, strict=False)
    now = snapshot(m)
    for k, v in before.items():
        assert torch.equal(now[k], v), f"{k} changed by a failed call"


class ComplexAndReal(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3, dtype=torch.complex64))
        self.r = nn.Parameter(torch.zeros(3))


@pytest.mark.parametrize("mode", MODES)
def test_lazy_conjugate_and_negative_views_in_a_state_dict_load_their_values(mode):
    """``z.conj()`` and ``torch._neg_view(x)`` are views whose values copy_ resolves."""
    z = torch.tensor([1 + 2j, 3 - 1j, -2 + 0.5j], dtype=torch.complex64)
    sd = {"w": z.conj(), "r": torch._neg_view(torch.arange(3.0))}
    e, result = eager(ComplexAndReal, sd)
    m = build_in(mode, ComplexAndReal)
    assert load_checkpoint(m, dict(sd)) == tuple(result)
    assert_same_tensors(e, materialize_module(m))


# -- state dict values that are not plain strided tensors ------------------------------

NOT_PLAIN = {
    # A tensor subclass whose storage holds its values.
    "subclass": "torch.full((3, 3), 4.0).as_subclass(type('Mine', (torch.Tensor,), {}))",
    # A wrapper subclass: no values in its own storage; copy_ dispatches through it.
    "wrapper": "TwoTensor(torch.ones(3, 3), torch.full((3, 3), 2.0))",
    # Layouts copy_ refuses into a dense tensor: load_state_dict raises, so must load_checkpoint.
    "sparse": "torch.eye(3).to_sparse()",
    "mkldnn": "torch.ones(3, 3).to_mkldnn()",
}

SCRIPT = """
import torch, torch.nn as nn
from torch.testing._internal.two_tensor import TwoTensor
from deferinit import deferred_init
from deferinit.materialize import load_checkpoint, materialize_module

def value():
    return {value}

eager = nn.Linear(3, 3)
try:
    eager.load_state_dict({{"weight": value(), "bias": torch.ones(3)}})
    expected = eager.weight.detach().clone()
except RuntimeError:
    expected = None
m = nn.Linear(3, 3) if "{mode}" == "real" else deferred_init(nn.Linear, 3, 3)
try:
    load_checkpoint(m, {{"weight": value(), "bias": torch.ones(3)}})
except RuntimeError as e:
    assert expected is None, f"eager loads it, load_checkpoint raised {{e}}"
    print("both refuse")
else:
    assert expected is not None, "eager refuses it, load_checkpoint loaded it"
    materialize_module(m)
    assert type(m.weight) is nn.Parameter and torch.equal(m.weight.detach(), expected), m.weight
    print("equal")
"""


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", list(NOT_PLAIN))
def test_state_dict_values_that_are_not_plain_tensors_load_as_eagerly(kind, mode):
    """Read through copy_ as eager's load reads them (their memory is not their
    values); in a subprocess: reading a wrapper subclass's memory crashed it."""
    import os
    import subprocess
    import sys

    if kind == "subclass" and mode == "deferred":
        pytest.xfail(
            "fake layer: any op of a deferred tensor with a Tensor subclass using the default "
            "__torch_function__ (deferred.copy_(sub), deferred * sub) raises 'Creating a new Tensor "
            "subclass ... already associated to a python object of type FakeTensor'"
        )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = SCRIPT.format(value=NOT_PLAIN[kind], mode=mode)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:] or f"killed by signal {-proc.returncode}"
