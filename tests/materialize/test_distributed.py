"""Sharded materialization: FSDP2, tensor parallel and FSDP1 on 2 and 4 gloo ranks.

The rank bodies are in ``tests/dist_workers.py``; ``tests/multiproc.py``
starts the ranks (spawn, 127.0.0.1, a free port), bounds every run in time
and turns a failing rank into a failing test with that rank's traceback.
Every check compares against eager PyTorch with the same seed.  The
single-process tests at the end need no process group.
"""

import time

import pytest
import torch

import dist_workers as workers
from multiproc import RankFailed, RanksTimedOut, run_ranks

from deferinit import deferred_init, is_deferred

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="needs torch.distributed with gloo",
)


# -- FSDP2 -----------------------------------------------------------------------------


def test_fsdp2_two_ranks_equal_eager_slices_and_train_like_eager():
    results = run_ranks(workers.case_fsdp2, 2)
    assert [r["params"] for r in results] == [21, 21]


@pytest.mark.slow
def test_fsdp2_four_ranks_with_an_empty_shard():
    run_ranks(workers.case_fsdp2, 4, timeout=180)


def test_fsdp2_materialize_tensor_in_reverse_order():
    run_ranks(workers.case_fsdp2_materialize_tensor, 2)


def test_fsdp2_peak_memory_is_shards_plus_one_full_parameter():
    # A fixed mmap threshold makes glibc return every freed tensor to the
    # system at once, so the resident size follows the live tensors.
    results = run_ranks(workers.case_memory, 2, env={"MALLOC_MMAP_THRESHOLD_": "65536"})
    for r in results:
        if "skipped" in r:
            pytest.skip(r["skipped"])
        # Generous bounds; replaying the whole record at once would peak at
        # every full parameter plus the shards (96 MiB here).
        assert r["peak"] <= r["shards"] + 1.5 * r["param"] + 4, r
        assert r["after"] <= r["shards"] + 4, r
        # The estimate read from the record: the shards plus one full parameter.
        assert r["planned"] == r["shards"] + r["param"], r


def test_sharded_memory_cost_keeps_its_former_names():
    from deferinit.materialize import distributed

    assert distributed.sharded_memory_plan is distributed.sharded_memory_cost
    assert distributed.GroupPlan is distributed.GroupCost


def test_fsdp2_progress_counts_each_ranks_shards():
    import re

    from deferinit.text import fmt_bytes

    for r in run_ranks(workers.case_fsdp2_progress, 2):
        assert re.search(rf"materializing {r['tensors']} tensors", r["log"]), r["log"]
        summary = re.search(r"deferinit: materialized (\d+) tensors \(([^)]+)\) in ", r["log"])
        assert summary and summary.groups() == (str(r["tensors"]), fmt_bytes(r["bytes"])), r["log"]


def test_llama_two_ranks_full_state_dict_equals_eager():
    pytest.importorskip("transformers")
    results = run_ranks(workers.case_llama, 2, timeout=180)
    assert all(r["tensors"] == 21 for r in results)


# -- tensor parallel ---------------------------------------------------------------------


def test_tensor_parallel_two_ranks():
    run_ranks(workers.case_tp, 2)


@pytest.mark.slow
def test_tensor_parallel_four_ranks():
    run_ranks(workers.case_tp, 4, timeout=180)


def test_scatter_of_differently_seeded_ranks_is_refused_on_every_rank():
    messages = run_ranks(workers.case_tp_rank_seeds, 2)
    for message in messages:
        assert "another recipe on rank(s) [1]" in message and "src_data_rank=None" in message


# -- FSDP1 -------------------------------------------------------------------------------


def test_fsdp1_param_init_fn_and_check_fn_forms():
    results = run_ranks(workers.case_fsdp1, 2)
    for r in results:
        assert r["param_init_fn"] and r["check_fn"]
        # FSDP1 wraps the blocks first, then the root (its own modules, BFS).
        assert r["calls"][:4] == ["Block", "LayerNorm", "Linear", "Linear"]
        assert r["calls"][-4:] == ["Net", "Embedding", "ModuleList", "Linear"]


def test_fsdp1_without_hooks_names_fsdp1_hooks():
    results = run_ranks(workers.case_fsdp1_without_hooks, 2)
    for messages in results:
        for form in ("torchdistx param_init_fn", "FSDP's own detection"):
            message = messages[form]
            assert message.startswith("FullyShardedDataParallel (FSDP1) is flattening deferred parameters (")
            assert "fc1.weight" in message and "neither called param_init_fn nor materialized them" in message
            assert "deferinit.materialize.distributed.fsdp1_hooks()" in message
            assert "with fsdp1_hooks(): model = FSDP(model, param_init_fn=param_init_fn" in message
            assert "build the model again (deferred_init)" in message
        message = messages["param_init_fn that does nothing"]
        assert "its param_init_fn left these parameters deferred" in message
        assert "param_init_fn=deferinit.materialize.distributed.param_init_fn" in message


def test_fsdp1_on_one_rank_without_hooks_warns_naming_fsdp1_hooks():
    ((messages, error),) = run_ranks(workers.case_fsdp1_one_rank_without_hooks, 1)
    assert len(messages) == 1, messages
    assert messages[0].startswith("FullyShardedDataParallel (FSDP1) wraps a module that is still deferred")
    assert "with fsdp1_hooks(): model = FSDP(model, param_init_fn=param_init_fn" in messages[0]
    # The error that follows says the same, not "Do this outside fake_mode" (no fake_mode was entered).
    assert error.startswith("MixedFakeError: tensor.data = "), error
    assert "was computed during a forward pass of FullyShardedDataParallel, which is still deferred" in error
    assert "with fsdp1_hooks(): model = FSDP(model, param_init_fn=param_init_fn" in error
    assert "fake_mode" not in error, error


# -- the harness never hangs ---------------------------------------------------------------


def test_a_failing_rank_fails_the_test_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankFailed, match="rank 1 failed on purpose"):
        run_ranks(workers.case_one_rank_fails, 2, timeout=60)
    assert time.monotonic() - start < 60


def test_a_hanging_rank_times_out_and_is_killed():
    # The deadline covers starting the ranks (spawn, import torch, join the
    # group): on a loaded 2-core machine 8 s did not leave rank 1 time to answer.
    with pytest.raises(RanksTimedOut, match=r"ranks \[0\]"):
        run_ranks(workers.case_one_rank_hangs, 2, timeout=30)


# -- single process ------------------------------------------------------------------------


def test_fsdp1_hooks_restore_fsdp_exactly():
    from torch.distributed.fsdp import _init_utils

    from deferinit.materialize.distributed import fsdp1_hooks

    before = {name: getattr(_init_utils, name, "<absent>") for name in ("_TORCHDISTX_AVAIL", "fake", "deferred_init")}
    with fsdp1_hooks():
        with fsdp1_hooks():
            assert _init_utils._TORCHDISTX_AVAIL is True
        assert _init_utils.fake.is_fake(deferred_init(torch.nn.Linear, 2, 2).weight)
        assert not _init_utils.fake.is_fake(torch.ones(1))
    after = {name: getattr(_init_utils, name, "<absent>") for name in before}
    assert after == before
    with pytest.raises(KeyError):
        with fsdp1_hooks():
            raise KeyError("inside")
    assert {name: getattr(_init_utils, name, "<absent>") for name in before} == before


def test_param_init_fn_materializes_only_the_modules_own_tensors():
    from deferinit.materialize.distributed import param_init_fn

    torch.manual_seed(0)
    eager = workers.Block(4)
    torch.manual_seed(0)
    block = deferred_init(workers.Block, 4)
    param_init_fn(block.fc2)
    assert not is_deferred(block.fc2) and is_deferred(block.fc1) and is_deferred(block.norm)
    assert is_deferred(block.scale)
    param_init_fn(block)  # the block's own buffer only
    assert not is_deferred(block.scale) and is_deferred(block.fc1)
    for sub in (block.norm, block.fc1):
        param_init_fn(sub)
    for name, t in eager.state_dict().items():
        assert torch.equal(block.state_dict()[name], t), name


def test_fingerprints_tell_recipes_apart():
    from deferinit.collectives import fingerprint

    torch.manual_seed(0)
    a = deferred_init(torch.randn, 3, 4)
    torch.manual_seed(0)
    b = deferred_init(torch.randn, 3, 4)
    torch.manual_seed(1)
    c = deferred_init(torch.randn, 3, 4)
    torch.manual_seed(0)
    d = deferred_init(torch.rand, 3, 4)
    assert fingerprint(a) == fingerprint(b)
    assert len({fingerprint(a), fingerprint(c), fingerprint(d), fingerprint(a[1:])}) == 4
    torch.manual_seed(0)
    e = deferred_init(lambda: torch.randn(3, 4).mul_(2.0))
    assert fingerprint(e) != fingerprint(a)


def test_modules_without_dtensors_take_the_usual_path():
    from deferinit.materialize.sharded import sharding_of

    m = deferred_init(torch.nn.Linear, 3, 2)
    assert sharding_of(m) is None  # the pipeline replays everything as one group
    assert is_deferred(m.weight)
