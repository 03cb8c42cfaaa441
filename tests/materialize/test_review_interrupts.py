"""Review attack: a KeyboardInterrupt at the lines of the jump branch's new
code paths (liveness's fill lane, the plan with loads, plain-leaf dressing)
while materializing leaves the module all deferred with the generators as
they were (or, after the commit, all real), and a second call gives eager's
values and generators; every STEP-th line those functions execute is hit in turn."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

from deferinit import deferred_init
from deferinit.materialize import load_checkpoint, materialize_module
from helpers import assert_same_tensors
from test_interrupts import all_or_nothing, interrupted_at  # its trace function, given the functions watched here

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The functions whose lines are interrupted, by file.
WATCHED = {
    os.path.join(ROOT, "deferinit", "ir", "liveness.py"): {"_filled", "_one_output", "_overwrites", "drawing"},
    os.path.join(ROOT, "deferinit", "ir", "plan.py"): {"_plan", "_streams_of", "_mark_planned"},
    os.path.join(ROOT, "materialize", "pipeline.py"): {"_dressed"},
    os.path.join(ROOT, "materialize", "swap.py"): {"dress_leaf", "_leaf"},
}
G = torch.Generator()
# Every STEP-th line those functions execute (about 400 and 700 in all): each
# trial builds and materializes twice under a trace function, and every line
# would take 5 s a test.
STEP = 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.p = nn.Parameter(torch.randn(4, generator=G))
        self.register_buffer("r", torch.empty(4).uniform_())
        self.b = nn.Linear(3, 2)


def _watched(code) -> bool:
    return code.co_name in WATCHED.get(code.co_filename, ())


def _loads(m):
    load_checkpoint(m, {"a.weight": torch.full((3, 3), 0.5), "r": torch.ones(4)}, strict=False)


@pytest.mark.parametrize("load", [False, True], ids=["plain", "with_loads"])
def test_an_interrupt_at_each_line_of_the_new_paths(load):
    def build():
        torch.manual_seed(0)
        G.manual_seed(1)
        m = Net()
        if load:
            m.load_state_dict({"a.weight": torch.full((3, 3), 0.5), "r": torch.ones(4)}, strict=False)
        return m

    eager = build()
    e_state, e_g = torch.get_rng_state(), G.get_state()
    k, hit = 1, 0
    while True:
        torch.manual_seed(0)
        G.manual_seed(1)
        d = deferred_init(Net)
        if load:
            _loads(d)
        before, g_before = torch.get_rng_state(), G.get_state()
        where = interrupted_at(k, _watched, lambda: materialize_module(d))
        if where is None:
            break
        hit += 1
        all_or_nothing(d, where, lambda: torch.equal(torch.get_rng_state(), before) and torch.equal(G.get_state(), g_before))
        materialize_module(d)
        assert_same_tensors(eager, d)
        assert torch.equal(torch.get_rng_state(), e_state) and torch.equal(G.get_state(), e_g), k
        k += STEP
    assert hit > 20, hit  # the watched functions were reached
    assert_same_tensors(eager, d)
    assert torch.equal(torch.get_rng_state(), e_state) and torch.equal(G.get_state(), e_g)
