"""What autograd saw of a recorded call, kept on its node for replay.

Replay recomputes eager's autograd graph (materialize/autograd.py) from two
facts recorded per call: which inputs were leaves requiring grad (shared
:class:`~deferinit.graph.Leaf` markers, so that one leaf read by several calls
is one tensor again) and which were fakes not requiring grad (``t.data``).
"""

from __future__ import annotations

import torch

from fake.tensor import FakeTensor

from .graph import Leaf

def _is_leaf(x: FakeTensor) -> bool:
    """A leaf requiring grad (a view taken under no_grad of a tensor requiring
    grad is not one: replay computes it from its base)."""
    try:
        return x.is_leaf and not (x._is_view() and x._base.requires_grad)
    except RuntimeError:
        # Autograd refuses to rebuild this view's grad_fn (a view taken under
        # no_grad whose base was written in place under grad mode).
        return False


def autograd_reads(flat, view: bool = False):
    """What autograd saw of this call: None if no input requires grad (and
    the call is no view), else ``(position, Leaf)`` for the inputs that are
    leaves requiring grad and ``(position, None)`` for the fakes that do not
    require grad (``t.data``: replay strips whatever graph its value has)."""
    entries = []
    requires = False
    for i, x in enumerate(flat):
        if not isinstance(x, torch.Tensor):
            continue
        if x.requires_grad:
            requires = True
            if isinstance(x, FakeTensor) and _is_leaf(x):
                d = x.__dict__
                leaf = d.get("_leaf")
                if leaf is None:
                    leaf = d["_leaf"] = Leaf()
                entries.append((i, leaf))
        elif isinstance(x, FakeTensor):
            entries.append((i, None))
    return tuple(entries) if requires or view else None
