"""Shared fixtures: every test leaves PyTorch's global state as it found it."""

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
for path in (os.path.dirname(HERE), HERE):  # the packages, and tests/helpers.py
    if path not in sys.path:
        sys.path.insert(0, path)


# The Fake layer patches torch.Tensor (.data, set_) while any fake is alive
# (fake/alive.py): one fake kept for the whole session gives every test that
# steady state to find and leave, whatever fakes a test keeps or drops.
# tests/test_guest.py checks, in fresh processes, that torch is left alone
# before the first fake and after the last.
from deferinit import fake  # noqa: E402

_SESSION_FAKE = fake.FakeTensor(torch.empty(0, device="meta"), "cpu")


def _global_state():
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from deferinit.fake.subclass import MAKE_SUBCLASS

    return (
        MAKE_SUBCLASS.users,
        vars(torch.Tensor).get("data"),
        vars(torch.Tensor).get("set_"),
        torch.get_default_dtype(),
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        len(_get_current_function_mode_stack()),
        len(_get_current_dispatch_mode_stack()),
        torch.nn.init._no_grad_trunc_normal_,
        vars(torch.Tensor).get("_make_subclass"),
    )


@pytest.fixture(autouse=True)
def _restores_global_state():
    # Every test starts from seed 0: a deferred model an earlier test kept
    # alive must not make this test's first model continue its random stream.
    torch.manual_seed(0)
    before = _global_state()
    yield
    assert _global_state() == before, "a test left modes, patches, default dtype or grad mode changed"


@pytest.fixture
def two_threads():
    """torch's intra-op threads set to 2 (checkpoint reads split over them), put back after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


# Files whose tests mostly spawn processes (gloo ranks, the command line, the
# docs' shell transcripts): about half the suite's time. CI runs the whole
# suite on the default torch and, on a second build (a CUDA build without a
# GPU), everything but these: `-m "not spawns and not slow"` (see .ci/run).
SPAWNS = {
    "test_checkpoint_dcp_distributed.py", "test_checkpoint_distributed.py", "test_distributed.py",
    "test_cli.py", "test_cli_config.py", "test_doc_shell.py",
}


def pytest_collection_modifyitems(config, items):
    # Hunts run only when asked for by name (`-m hunt`): minutes each, they
    # would put `make test` over its 20 minutes.
    hunting = "hunt" in (config.getoption("markexpr") or "")
    for item in items:
        if os.path.basename(str(item.fspath)) in SPAWNS:
            item.add_marker(pytest.mark.spawns)
        if not hunting and item.get_closest_marker("hunt") is not None:
            item.add_marker(pytest.mark.skip(reason="a long hunt, run by hand: pytest -m hunt (docs/testing.md)"))
