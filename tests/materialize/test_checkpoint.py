"""load_checkpoint: every source format, deferred and real modules, against eager
construction followed by ``load_state_dict`` of the same tensors (issue 12).

The reference of every test: the module built eagerly under the same seed,
then ``load_state_dict`` of the checkpoint's tensors, then the next draw of
the default generator.  Kernels that ran during materialization are counted
with ``torch.profiler`` (replay runs below every dispatch mode).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from deferinit import CheckpointMismatchError, deferred_init, graph_of, is_deferred
from helpers import assert_same_tensors, check_jump_models
from deferinit.materialize import LoadResult, load_checkpoint, materialize_module, materialize_tensor

RANDOM_KERNELS = ("uniform_", "normal_", "random_", "bernoulli", "exponential_", "randn", "rand")


class MLP(nn.Module):
    def __init__(self, d=6):
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.norm = nn.LayerNorm(2 * d)
        self.down = nn.Linear(2 * d, d)


class Tied(nn.Module):
    """GPT-like: the head is the embedding, a buffer, a trunc_normal_ parameter."""

    def __init__(self, vocab=11, d=4):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.empty(3, d))
        nn.init.trunc_normal_(self.pos, std=0.2)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.bn = nn.BatchNorm2d(3)


MODELS = {"mlp": MLP, "tied": Tied, "convbn": ConvBN}


def checkpoint_of(build, seed=123) -> dict:
    """A state dict unlike the deferred module's initialization (another seed,
    buffers changed too), without the duplicate names of tied tensors."""
    torch.manual_seed(seed)
    m = build()
    with torch.no_grad():
        for t in m.buffers():
            t.add_(3)
    sd, seen = {}, set()
    for k, v in m.state_dict().items():
        if (v.data_ptr(), v.shape) not in seen:  # state_dict() detaches: ties share memory
            seen.add((v.data_ptr(), v.shape))
            sd[k] = v.clone()
    return sd


def reference(build, sd, seed=0):
    """Eager construction, then load_state_dict of the same tensors; and the next draw."""
    torch.manual_seed(seed)
    m = build()
    m.load_state_dict(sd, strict=False)
    return m, torch.rand(8)


def untouched_next(seed=0):
    """The next draw of a generator that nothing advanced since seeding."""
    torch.manual_seed(seed)
    return torch.rand(8)


def random_kernels(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    check_jump_models()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events() if any(k in e.name for k in RANDOM_KERNELS)]


def save_as(fmt: str, sd: dict, folder: str):
    """Write ``sd`` in format ``fmt``; returns the source to pass and the tensors as read back."""
    path = os.path.join(folder, "ckpt")
    if fmt == "state_dict":
        return sd, sd
    if fmt == "safetensors":
        save_file(sd, path + ".safetensors")
        return path + ".safetensors", sd
    if fmt == "safetensors_bf16":  # cast to the parameter's dtype when loaded
        low = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in sd.items()}
        save_file(low, path + ".safetensors")
        return path + ".safetensors", low
    if fmt == "torch":
        torch.save({"model": sd, "step": 7}, path + ".pt")
        return path + ".pt", {"model." + k: v for k, v in sd.items()}
    if fmt in ("dir_index", "dir_glob"):
        os.makedirs(path)
        keys = list(sd)
        halves = [keys[: len(keys) // 2], keys[len(keys) // 2 :]]
        weight_map = {}
        for i, part in enumerate(halves):
            name = f"model-{i + 1:05d}-of-00002.safetensors"
            save_file({k: sd[k] for k in part}, os.path.join(path, name))
            weight_map.update({k: name for k in part})
        if fmt == "dir_index":
            import json

            with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {}, "weight_map": weight_map}, f)
        return path, sd
    raise ValueError(fmt)


FORMATS = ["state_dict", "safetensors", "safetensors_bf16", "torch", "dir_index", "dir_glob"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("model", list(MODELS))
def test_every_format_equals_eager_then_load_state_dict(model, fmt, tmp_path):
    build = MODELS[model]
    source, tensors = save_as(fmt, checkpoint_of(build), str(tmp_path))
    prefix = "model." if fmt == "torch" else ""
    eager, _ = reference(build, {k[len(prefix):]: v for k, v in tensors.items()})

    torch.manual_seed(0)
    m = deferred_init(build)
    assert load_checkpoint(m, source, prefix=prefix) == LoadResult([], [])
    assert is_deferred(m)
    ran = random_kernels(lambda: materialize_module(m))
    assert_same_tensors(eager, m)
    # Every random result is overwritten: no random kernel runs, and the
    # generator stays where it was (the state eager construction leaves is
    # not known without running the draws).
    assert ran == []
    assert torch.equal(torch.rand(8), untouched_next())


@pytest.mark.parametrize("model", list(MODELS))
def test_real_module_loads_at_once(model, tmp_path):
    build = MODELS[model]
    source, tensors = save_as("safetensors_bf16", checkpoint_of(build), str(tmp_path))
    eager, _ = reference(build, tensors)
    torch.manual_seed(0)
    m = build()
    assert load_checkpoint(m, source) == LoadResult([], [])
    assert_same_tensors(eager, m)


def test_partly_materialized_module_loads_real_tensors_now_and_deferred_ones_later(tmp_path):
    sd = checkpoint_of(MLP)
    source, _ = save_as("safetensors", sd, str(tmp_path))
    eager, _ = reference(MLP, sd)
    torch.manual_seed(0)
    m = deferred_init(MLP)
    materialize_tensor(m.up.weight)
    load_checkpoint(m, source)
    assert not is_deferred(m.up.weight) and torch.equal(m.up.weight, sd["up.weight"])
    assert is_deferred(m.down.weight)
    materialize_module(m)
    assert_same_tensors(eager, m)


@pytest.mark.parametrize("keep", [("up.",), ("up.", "norm."), ("down.",), ("norm.",)])
def test_missing_keys_keep_their_recorded_initialization(keep, tmp_path):
    """Values equal eager + load_state_dict(strict=False), bit for bit; the
    generator is eager's when the last draw is live, else left where it was."""
    sd = {k: v for k, v in checkpoint_of(MLP).items() if k.startswith(keep)}
    source, _ = save_as("safetensors", sd, str(tmp_path))
    eager, eager_next = reference(MLP, sd)
    torch.manual_seed(0)
    m = deferred_init(MLP)
    result = load_checkpoint(m, source, strict=False)
    assert result == tuple(eager.load_state_dict(sd, strict=False))
    ran = random_kernels(lambda: materialize_module(m))
    assert_same_tensors(eager, m)
    down_loaded = "down." in keep
    # The draws of the tensors read are replayed; the generator jumps over the
    # earlier ones (a live draw needs the state they leave); overwritten draws
    # at the end are not replayed at all.
    assert len(ran) == 2 * sum(layer not in keep for layer in ("up.", "down."))  # the live draws only
    assert torch.equal(torch.rand(8), untouched_next() if down_loaded else eager_next)


def test_strict_refuses_missing_and_unexpected_keys_and_records_nothing(tmp_path):
    sd = checkpoint_of(MLP)
    sd["extra.weight"] = torch.zeros(2)
    del sd["up.bias"]
    source, _ = save_as("safetensors", sd, str(tmp_path))
    torch.manual_seed(0)
    m = deferred_init(MLP)
    before = str(graph_of(m))
    with pytest.raises(CheckpointMismatchError) as info:
        load_checkpoint(m, source)
    message = str(info.value)
    assert "'up.bias'" in message and "'extra.weight'" in message and "strict=False" in message
    assert str(graph_of(m)) == before
    torch.manual_seed(0)
    eager = MLP()
    assert load_checkpoint(m, source, strict=False) == tuple(eager.load_state_dict(sd, strict=False))


def test_shape_mismatch_names_the_key_and_records_nothing(tmp_path):
    sd = checkpoint_of(MLP)
    sd["down.weight"] = torch.zeros(5, 12)
    source, _ = save_as("safetensors", sd, str(tmp_path))
    torch.manual_seed(0)
    m = deferred_init(MLP)
    before = str(graph_of(m))
    with pytest.raises(CheckpointMismatchError, match=r"down.weight.*\[5, 12\].*\[6, 12\]"):
        load_checkpoint(m, source, strict=False)
    assert str(graph_of(m)) == before
    eager = MLP()
    with pytest.raises(RuntimeError, match="size mismatch for down.weight"):
        eager.load_state_dict(sd, strict=False)  # the reference refuses it too


def test_prefix_and_rename(tmp_path):
    sd = checkpoint_of(MLP)
    source, _ = save_as("safetensors", {"model." + k.replace("up", "fc1"): v for k, v in sd.items()} | {"lm.x": torch.ones(1)}, str(tmp_path))
    eager, _ = reference(MLP, sd)
    torch.manual_seed(0)
    m = deferred_init(MLP)
    rename = lambda k: k.replace("fc1", "up")  # noqa: E731
    assert load_checkpoint(m, source, prefix="model.", rename=rename) == LoadResult([], [])
    materialize_module(m)
    assert_same_tensors(eager, m)
    torch.manual_seed(0)
    m = deferred_init(MLP)
    result = load_checkpoint(m, source, prefix="model.", rename=lambda k: None if "fc1" in k else k, strict=False)
    assert result == LoadResult(["up.weight", "up.bias"], [])


def test_tied_tensor_loaded_from_any_of_its_names_last_one_wins(tmp_path):
    sd = checkpoint_of(Tied)
    assert "head.weight" not in sd  # saved once, as safetensors' save_model does
    torch.manual_seed(0)
    m = deferred_init(Tied)
    assert load_checkpoint(m, sd) == LoadResult([], [])  # head.weight is wte.weight: not missing
    both = dict(sd, **{"head.weight": torch.full_like(sd["wte.weight"], 2.0)})
    eager, _ = reference(Tied, both)
    torch.manual_seed(0)
    m = deferred_init(Tied)
    load_checkpoint(m, both)
    materialize_module(m)
    assert_same_tensors(eager, m)
    assert m.head.weight is m.wte.weight and float(m.wte.weight.detach()[0, 0]) == 2.0


def test_a_shape_one_tensor_loads_into_a_zero_dim_parameter():
    class Scalar(nn.Module):
        def __init__(self):
            super().__init__()
            self.t = nn.Parameter(torch.randn(()))

    sd = {"t": torch.tensor([4.5])}
    eager, _ = reference(Scalar, sd)
    torch.manual_seed(0)
    m = deferred_init(Scalar)
    load_checkpoint(m, sd)
    materialize_module(m)
    assert_same_tensors(eager, m)


def test_writes_after_the_load_are_replayed_on_it(tmp_path):
    sd = checkpoint_of(MLP)
    source, _ = save_as("safetensors", sd, str(tmp_path))
    torch.manual_seed(0)
    eager = MLP()
    eager.load_state_dict(sd)
    with torch.no_grad():
        eager.up.weight.mul_(2)
        eager.down.bias[1:].zero_()
    torch.manual_seed(0)
    m = deferred_init(MLP)
    load_checkpoint(m, source)
    with torch.no_grad():
        m.up.weight.mul_(2)
        m.down.bias[1:].zero_()
    materialize_module(m)
    assert_same_tensors(eager, m)


def test_deferred_state_dict_values_are_recorded_copies():
    torch.manual_seed(5)
    source = deferred_init(MLP)
    torch.manual_seed(5)
    expected = MLP().state_dict()
    torch.manual_seed(0)
    m = deferred_init(MLP)
    load_checkpoint(m, source.state_dict())
    materialize_module(m)
    assert is_deferred(source)
    for k, v in m.state_dict().items():
        assert torch.equal(v, expected[k]), k


def test_a_second_load_hides_the_first(tmp_path):
    first, second = checkpoint_of(MLP, seed=1), checkpoint_of(MLP, seed=2)
    save_file(first, tmp_path / "a.safetensors")
    save_file(second, tmp_path / "b.safetensors")
    eager, _ = reference(MLP, second)
    torch.manual_seed(0)
    m = deferred_init(MLP)
    load_checkpoint(m, tmp_path / "a.safetensors")
    load_checkpoint(m, tmp_path / "b.safetensors")
    os.remove(tmp_path / "a.safetensors")  # not read: its loads are hidden
    materialize_module(m)
    assert_same_tensors(eager, m)


def test_tensors_are_read_once(tmp_path):
    """Bytes read while materializing: the checkpoint's, once (rchar of /proc)."""
    if not os.path.exists("/proc/self/io"):
        pytest.skip("needs /proc/self/io")

    def build():
        return nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 256))

    sd = checkpoint_of(build)
    path = tmp_path / "m.safetensors"
    save_file(sd, path)
    nbytes = sum(v.numel() * v.element_size() for v in sd.values())
    torch.manual_seed(0)
    m = deferred_init(build)
    load_checkpoint(m, path)
    before = _rchar()
    materialize_module(m)
    read = _rchar() - before
    assert nbytes <= read < nbytes + 64 * 1024, (read, nbytes)
    for k, v in m.state_dict().items():
        assert torch.equal(v, sd[k])


def _rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("no rchar")


def test_safetensors_file_read_back_equals_load_file(tmp_path):
    """The reader's view of a file is safetensors' own (many dtypes, 0-dim, empty)."""
    tensors = {
        "f64": torch.randn(3, 2, dtype=torch.float64),
        "f16": torch.randn(5).half(),
        "i8": torch.arange(-3, 3, dtype=torch.int8),
        "b": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }
    save_file(tensors, tmp_path / "t.safetensors")

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            for k, v in tensors.items():
                self.register_buffer(k, torch.zeros_like(v))

    m = deferred_init(Holder)
    load_checkpoint(m, tmp_path / "t.safetensors")
    materialize_module(m)
    expected = load_file(tmp_path / "t.safetensors")
    for k, v in m.state_dict().items():
        assert v.dtype == expected[k].dtype and torch.equal(v, expected[k]), k


def test_the_record_shows_loads():
    """graph_of prints the load after the initialization it hides; to_dot labels it."""
    from deferinit import to_dot

    m = deferred_init(nn.Linear, 3, 2)
    load_checkpoint(m, {"weight": torch.ones(2, 3)}, strict=False)
    lines = str(graph_of(m)).splitlines()
    assert lines[-1] == "%4 = load(%2, 'weight' of the state dict [2, 3] float32)  # weight"
    assert lines[2].startswith("%2 = aten.uniform_(%0")
    label = next(line for line in to_dot(m).source.splitlines() if "load" in line)
    assert "'weight'" in label and "[2, 3] float32" in label
