"""The default generator after materializing DTensors, on 4 gloo ranks, against eager.

``distribute_tensor`` of a deferred ``torch.randn`` on 4 ranks: for shapes
whose rows or columns do not divide among the ranks, some rank's piece is
empty (``new_zeros``, which reads the source for its geometry only).  That
rank needs none of the source's values, yet eager drew them on every rank:
the generator afterwards must be eager's on every rank, whatever the
placement, ``src_data_rank`` and whether the deferred source is kept.
(Dead-work elimination once only allocated such a draw, and only the ranks
that needed values moved their generator: tests/dist_workers.py's
``case_tp`` keeps its deferred source alive but checked the generator only
after whole modules, whose sources are temporaries.)
"""

import pytest
import torch

import generator_workers as workers
from multiproc import run_ranks

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="needs torch.distributed with gloo",
)


def test_distribute_tensor_generator_after_equals_eager_on_four_ranks():
    problems = [p for rank in run_ranks(workers.case_distribute_generator, 4, timeout=300) for p in rank]
    assert not problems, "\n".join(problems)
