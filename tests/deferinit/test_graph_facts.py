"""The IR holds what was recorded: autograd's facts grouped on the node, analysis results outside it."""

import pytest
import torch
import torch.nn as nn

from deferinit import deferred_init
from deferinit.ir.graph import NOTHING_SEEN, AutogradFacts, Input
from deferinit.ir.liveness import hidden_by_load
from deferinit.ir.plan import Plan, read_of


def _nodes(*fakes):
    seen, todo = {}, [f._storage.head or f._value.node for f in fakes]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        for x in node.flat:
            if type(x) is Input:
                todo += [x.value.node, x.version]
    return list(seen.values())


def test_analyses_leave_the_nodes_as_recorded():
    """A copy_ from a real tensor after deferral (what load_state_dict does)
    hides reset_parameters' uniform_ of the weight: the liveness pass says so
    in its own table, and every node is as it was recorded."""
    torch.manual_seed(0)
    m = deferred_init(nn.Linear, 4, 4)
    with torch.no_grad():
        m.weight.copy_(torch.ones(4, 4))
    nodes = _nodes(m.weight)
    before = [dict(n.__dict__) for n in nodes]
    Plan([read_of(m.weight)])
    assert [dict(n.__dict__) for n in nodes] == before
    draws = [n for n in nodes if n.rng is not None]
    assert len(draws) == 1 and hidden_by_load(draws[0])  # the weight's uniform_
    assert not any(hidden_by_load(n) for n in _nodes(m.bias))


def test_autograd_facts_are_one_object_per_node_that_autograd_saw():
    m = deferred_init(nn.Linear, 4, 4)
    view = m.weight[1:]  # a view of a parameter under grad mode
    node = view._value.node
    assert type(node.autograd) is AutogradFacts and node.autograd.base_version == m.weight._version
    assert node.autograd.grad is not None and not node.autograd.no_grad
    empty = m.bias._storage.head  # uniform_ under no_grad: autograd saw nothing
    assert empty.autograd is NOTHING_SEEN and empty.autograd.grad is None
    with pytest.raises(AttributeError):
        NOTHING_SEEN.grad = ()
