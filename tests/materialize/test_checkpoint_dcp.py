"""load_checkpoint of a PyTorch distributed checkpoint (a ``dcp.save`` directory),
in one process, against ``dcp.load`` into the eager module (issue 18 item 4).

The multi-rank cases (saved on N ranks, loaded on M, FSDP2, tensor parallel,
2-D) are in test_checkpoint_dcp_distributed.py; the refusals of corrupt
and hostile directories in test_checkpoint_dcp_errors.py.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn as nn

from deferinit import deferred_init, is_deferred
from helpers import assert_same_tensors
from deferinit.materialize import LoadResult, load_checkpoint, materialize_module

dcp = pytest.importorskip("torch.distributed.checkpoint")


def _base():
    """test_checkpoint.py's models and references (the same cases as the safetensors tests)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "checkpoint_cases", os.path.join(os.path.dirname(os.path.abspath(__file__)), "test_checkpoint.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


base = _base()


def save(state: dict, path) -> str:
    """``dcp.save`` in this process (no process group), as a single-process job saves."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return str(path)


def dcp_load_into(module: nn.Module, path: str, prefix: str = "") -> nn.Module:
    """The reference: ``dcp.load`` into the module's own state dict (its tensors, in place)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    state = module.state_dict()
    wanted = {prefix + k: v for k, v in state.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(wanted, checkpoint_id=path, no_dist=True, planner=DefaultLoadPlanner(allow_partial_load=True))
    return module


@pytest.mark.parametrize("model", list(base.MODELS))
def test_deferred_module_equals_dcp_load_into_eager(model, tmp_path):
    build = base.MODELS[model]
    path = save(base.checkpoint_of(build), tmp_path / "ckpt")
    torch.manual_seed(0)
    eager = dcp_load_into(build(), path)

    torch.manual_seed(0)
    m = deferred_init(build)
    assert load_checkpoint(m, path) == LoadResult([], [])
    assert is_deferred(m)
    ran = base.random_kernels(lambda: materialize_module(m))
    assert_same_tensors(eager, m)
    assert ran == []  # every initializer is overwritten: none runs
    assert torch.equal(torch.rand(8), base.untouched_next())


@pytest.mark.parametrize("model", list(base.MODELS))
def test_real_module_loads_at_once(model, tmp_path):
    build = base.MODELS[model]
    path = save(base.checkpoint_of(build), tmp_path / "ckpt")
    torch.manual_seed(0)
    eager = dcp_load_into(build(), path)
    torch.manual_seed(0)
    m = build()
    assert load_checkpoint(m, path) == LoadResult([], [])
    assert_same_tensors(eager, m)


def test_nested_state_and_values_that_are_not_tensors(tmp_path):
    """What a training job saves: the model under "model", a step count, the
    optimizer; keys are DCP's flattened names."""
    build = base.MLP
    sd = base.checkpoint_of(build)
    path = save({"model": sd, "step": 7, "note": {"text": "hello"}}, tmp_path / "ckpt")
    torch.manual_seed(0)
    eager = dcp_load_into(build(), path, prefix="model.")
    torch.manual_seed(0)
    m = deferred_init(build)
    assert load_checkpoint(m, path, prefix="model.") == LoadResult([], [])
    materialize_module(m)
    assert_same_tensors(eager, m)
    # Without the prefix every tensor is unexpected; the step and the note are not tensors.
    torch.manual_seed(0)
    result = load_checkpoint(deferred_init(build), path, strict=False)
    assert sorted(result.unexpected_keys) == sorted("model." + k for k in sd)


def test_dtype_cast_strided_and_zero_dim_tensors(tmp_path):
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(5, 3))
            self.t = nn.Parameter(torch.randn(4, 6))
            self.s = nn.Parameter(torch.randn(()))
            self.register_buffer("count", torch.zeros((), dtype=torch.int64))

    torch.manual_seed(3)
    state = {
        "w": torch.randn(5, 3).to(torch.bfloat16),  # cast to float32 on load, as copy_ casts
        "t": torch.randn(6, 4).t(),  # stored with its own strides
        "s": torch.tensor(2.5),
        "count": torch.tensor(41),
    }
    path = save(state, tmp_path / "ckpt")
    torch.manual_seed(0)
    eager = dcp_load_into(Odd(), path)
    torch.manual_seed(0)
    m = deferred_init(Odd)
    load_checkpoint(m, path)
    materialize_module(m)
    assert_same_tensors(eager, m)
    assert torch.equal(m.t.detach(), state["t"]) and m.w.dtype == torch.float32


def test_metadata_is_pytorchs_own(tmp_path):
    """The metadata read without pickle.load is the object FileSystemReader reads."""
    from deferinit.materialize.checkpoint.dcp_metadata import read_metadata

    path = save({"model": base.checkpoint_of(base.Tied), "step": 3}, tmp_path / "ckpt")
    ours = read_metadata(path)
    theirs = dcp.FileSystemReader(path).read_metadata()
    assert type(ours) is type(theirs)
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data
    assert ours.planner_data == theirs.planner_data
    assert ours.storage_meta.save_id == theirs.storage_meta.save_id


def test_a_part_reads_its_own_bytes(tmp_path):
    """A block of rows or columns reads that block's elements, not the tensor."""
    if not os.path.exists("/proc/self/io"):
        pytest.skip("needs /proc/self/io")
    from deferinit.materialize.checkpoint.dcp import open_dcp

    def rchar() -> tuple[int, int]:
        # The counter, and the bytes this read of /proc/self/io added to it:
        # its length changes when a number gains a digit, so it is measured
        # each time, not once.
        with open("/proc/self/io", "rb") as f:
            text = f.read()
        line = next(x for x in text.splitlines() if x.startswith(b"rchar:"))
        return int(line.split()[1]), len(text)

    w = torch.randn(256, 512)
    path = save({"w": w}, tmp_path / "ckpt")
    entry = open_dcp(path)["w"]
    entry.source.need([entry])  # the chunks' layouts, read as load_checkpoint reads them
    for start, sizes in [((64, 0), (32, 512)), ((0, 128), (256, 64)), ((10, 7), (1, 3))]:
        out = torch.empty(sizes)
        before, own = rchar()
        entry.box(start, sizes).read_parts(out)
        read = rchar()[0] - before - own
        assert torch.equal(out, w[start[0] : start[0] + sizes[0], start[1] : start[1] + sizes[1]])
        assert read == out.numel() * 4, (start, sizes, read)


def test_titan_fused_qkv_checkpoint_loads_through_its_pre_hook(tmp_path):
    """torchtitan's Llama with a fused wqkv saves wq/wk/wv (a state_dict hook
    splits it) and merges them in a load_state_dict pre-hook.  load_checkpoint
    runs that hook as load_state_dict does: the model equals eager
    load_state_dict of the same checkpoint, and no initializer runs."""
    pytest.importorskip("torchtitan.models.llama3")
    from torchtitan.models.llama3 import _debugmodel

    config = _debugmodel("flex")
    torch.manual_seed(7)
    saved = config.build()
    state = saved.state_dict()
    assert any(k.endswith("qkv_linear.wq.weight") for k in state)  # the split keys
    path = save(state, tmp_path / "ckpt")
    torch.manual_seed(0)
    eager = config.build()
    assert tuple(eager.load_state_dict(dcp_to_state_dict(path))) == ([], [])
    torch.manual_seed(0)
    m = deferred_init(config.build)
    assert load_checkpoint(m, path) == LoadResult([], [])
    ran = base.random_kernels(lambda: materialize_module(m))
    assert_same_tensors(eager, m)
    assert ran == []


def dcp_to_state_dict(path: str) -> dict:
    """The checkpoint as one state dict, by PyTorch's own converter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = os.path.join(os.path.dirname(path), "converted.pt")
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=True)


def test_titan_fused_qkv_loads_a_checkpoint_by_parameter_names(tmp_path):
    """load_checkpoint needs no state_dict() of the model (whose hook gathers and
    splits the fused wqkv): a checkpoint keyed by the module's own names loads,
    equal to eager load_state_dict of the same tensors (the merge hook leaves
    wqkv keys alone)."""
    pytest.importorskip("torchtitan.models.llama3")
    from torchtitan.models.llama3 import _debugmodel

    config = _debugmodel("flex")
    torch.manual_seed(7)
    saved = config.build()
    state = {k: v.detach().clone() for k, v in saved.named_parameters()}
    state.update((k, v.clone()) for k, v in saved.state_dict().items() if k not in state and "qkv_linear.w" not in k)
    path = save(state, tmp_path / "ckpt")
    torch.manual_seed(0)
    eager = config.build()
    assert tuple(eager.load_state_dict(state)) == ([], [])
    torch.manual_seed(0)
    m = deferred_init(config.build)
    assert load_checkpoint(m, path) == LoadResult([], [])
    ran = base.random_kernels(lambda: materialize_module(m))
    assert_same_tensors(eager, m)
    assert ran == []
