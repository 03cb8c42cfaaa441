"""A guest in the user's process (issue 26, item 1): torch is left alone.

Importing changes no attribute of torch; once no fake tensor is alive (all
materialized or collected), every attribute is PyTorch's own object again;
in between, only what deferinit.fake.replaced lists is replaced.  Each
check runs in a fresh interpreter (the test session keeps a fake alive, see
conftest.py) and compares snapshots of torch (tests/torch_snapshot.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import torch_snapshot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")

PRELUDE = """
import gc, sys, warnings
import torch
import torch.nn as nn
import torch_snapshot as snap
warnings.simplefilter("ignore")
BEFORE = snap.take()
import deferinit, deferinit.fake, deferinit.materialize
from deferinit import deferred, deferred_init
from deferinit.fake import fake_mode
from deferinit.materialize import materialize_module, materialize_tensor

def unchanged(what):
    gc.collect()
    found = snap.differences(BEFORE, snap.take())
    assert not found, f"{what}: torch changed: {found}"

def only_listed(what, expect=(), modes_active=False):
    found = snap.differences(BEFORE, snap.take())
    extra = snap.unlisted(found, modes_active)
    assert not extra, f"{what}: unlisted changes {extra}"
    for item in expect:
        assert item in found, f"{what}: {item} not replaced ({found})"
    return found
"""


def isolated(body: str, timeout: int = 600) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")]))
    code = PRELUDE + textwrap.dedent(body)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert r.returncode == 0, f"exit status {r.returncode}\n{r.stdout}\n{r.stderr[-4000:]}"
    return r.stdout


def test_import_changes_nothing_and_the_last_fake_gone_leaves_nothing():
    out = isolated("""
    unchanged("import")

    # A deferral, looked at while it records and after, then materialized.
    seen = {}
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            nn.init.trunc_normal_(self.a.weight)
            seen["recording"] = only_listed("recording", [("torch.Tensor", "_make_subclass"),
                                                          ("torch", "manual_seed"), ("torch", "__class__")],
                                            modes_active=True)
            self.b = nn.TransformerEncoderLayer(8, 2, 16)
    torch.manual_seed(0)
    m = deferred_init(Net)
    only_listed("deferred, alive", [("torch.Tensor", "data"), ("torch.Tensor", "set_"),
                                    ("torch.Tensor", "_make_subclass"), ("torch", "rand")])
    materialize_module(m)
    unchanged("materialized")

    # Dropped without materialization.
    m = deferred_init(Net)
    del m
    unchanged("collected")

    # Partly materialized, then dropped.
    m = deferred_init(Net)
    materialize_tensor(m.a.weight)
    del m
    unchanged("partly materialized, collected")

    # Materialized tensor by tensor.
    m = deferred_init(nn.Linear, 3, 3)
    materialize_tensor(m.weight)
    materialize_tensor(m.bias)
    unchanged("tensor by tensor")

    # Plain fakes of fake_mode.
    with fake_mode(fake_cuda=True):
        f = torch.ones(2, device="cuda")
        only_listed("fake_mode", [("torch.Tensor", "_make_subclass")], modes_active=True)
    only_listed("plain fake alive", [("torch.Tensor", "data"), ("torch.Tensor", "_make_subclass")])
    del f
    unchanged("plain fake collected")

    # A real tensor that became a fake (real.data = fake), then materialized.
    with deferred():
        src = nn.Linear(2, 2)
    p = nn.Parameter(torch.zeros(1))
    p.data = src.weight
    del src
    materialize_tensor(p)
    unchanged("real.data = fake, materialized")

    # A failure inside the constructor.
    def fails():
        nn.Linear(2, 2)
        raise ValueError("boom")
    try:
        deferred_init(fails)
    except ValueError:
        pass
    unchanged("failed deferral")

    # with deferred(): and a reseed between deferral and materialization.
    with deferred():
        m = nn.Linear(2, 2)
    torch.manual_seed(0)
    materialize_module(m)
    del m
    unchanged("deferred() block")

    # A checkpoint loaded into a deferred model.
    from deferinit.materialize import load_checkpoint
    m = deferred_init(nn.Linear, 2, 2)
    load_checkpoint(m, {"weight": torch.ones(2, 2), "bias": torch.zeros(2)})
    materialize_module(m)
    del m
    unchanged("loaded")
    print("ok")
    """)
    assert "ok" in out


def test_torch_compile_of_plain_data_assignment_works_once_no_fake_is_alive():
    """The report: after one deferral was materialized, torch.compile of plain
    ``x.data = y`` failed ("module 'torch' has no attribute 'set_'") because
    torch.Tensor.data and set_ stayed replaced."""
    out = isolated("""
    m = deferred_init(nn.Linear, 2, 2)
    materialize_module(m)
    unchanged("materialized")

    def step(x, y):
        x.data = y
        return x + 1

    out = torch.compile(step, backend="eager")(torch.zeros(2), torch.ones(2))
    assert torch.equal(out, torch.full((2,), 2.0)), out
    print("ok")
    """)
    assert "ok" in out


def test_dynamo_imported_while_a_deferral_is_pending_wraps_torch_manual_seed_as_without_us():
    """torch._dynamo's import wraps ``torch.manual_seed`` in ``_disable_dynamo`` only
    if it is ``torch.random.manual_seed`` (the same object), and often runs while a
    deferred model waits (``torch.optim``, ``torch.compile``).  Our diversions of
    the two names were two objects, so dynamo left it unwrapped, and putting
    torch's back left the process without dynamo's wrapper for good (torch.compile
    of a function calling ``torch.manual_seed`` traced 23 frames instead of 2).
    Now one diverted object serves both names, and dynamo's wrapper of it wraps
    torch's function again once we are gone: as in a process without deferinit."""
    eager = isolated("""
    import torch._dynamo
    print(torch.manual_seed is not torch.random.manual_seed,
          torch.manual_seed.__wrapped__ is torch.random.manual_seed)
    """)
    deferred = isolated("""
    m = deferred_init(nn.Linear, 2, 2)
    import torch._dynamo
    materialize_module(m)
    del m
    gc.collect()
    print(torch.manual_seed is not torch.random.manual_seed,
          torch.manual_seed.__wrapped__ is torch.random.manual_seed)
    assert not hasattr(torch.manual_seed, "__deferinit_original__")
    _ = torch.manual_seed(3)
    a = torch.rand(2)
    _ = torch.random.manual_seed(3)
    assert torch.equal(a, torch.rand(2))
    """)
    assert eager.split() == ["True", "True"], eager
    assert deferred.split() == eager.split(), deferred


def test_snapshot_sees_a_replaced_attribute_and_an_unlisted_one():
    """The comparison can fail: a replaced attribute, a module's class and a mode
    are seen, and an attribute the table does not list is reported as such."""
    before = torch_snapshot.take()
    saved = torch.nn.init.normal_
    torch.nn.init.normal_ = lambda *a, **k: None
    try:
        with torch.inference_mode():
            found = torch_snapshot.differences(before, torch_snapshot.take())
    finally:
        torch.nn.init.normal_ = saved
    assert ("torch.nn.init", "normal_") in found
    assert ("torch.nn.init", "normal_") in torch_snapshot.unlisted(found)
    assert any(item[0] == "inference" for item in found)
    assert torch_snapshot.unlisted([("torch.Tensor", "data"), ("torch", "rand")]) == []
    assert not torch_snapshot.differences(before, torch_snapshot.take())


def test_every_patch_installs_only_listed_names():
    """SharedPatch refuses a name the table does not list."""
    import math

    from deferinit.fake.patch import SharedPatch

    patch = SharedPatch("trunc normal", "torch.nn.init", lambda: math, lambda m: {"normal_": 1})
    with pytest.raises(AssertionError, match="not listed"):
        patch.acquire("x")
    assert not hasattr(math, "normal_")


def test_the_design_note_lists_every_replacement():
    """docs/design.md's table of replaced attributes is fake/replaced.py's."""
    from deferinit.fake.replaced import RANDOM_OPS, TABLE

    with open(os.path.join(ROOT, "docs", "design.md")) as f:
        text = f.read()
    section = text[text.index("## A guest in the user's process"):]
    for entry in TABLE.values():
        for owner in entry.owner:
            assert f"`{owner}`" in section, owner
        if entry.names != RANDOM_OPS:
            for name in entry.names:
                assert f"`{name}`" in section, name
        assert entry.until in section, entry.until
