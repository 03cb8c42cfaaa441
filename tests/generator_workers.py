"""Rank bodies for tests/materialize/test_distributed_generators.py (spawn children
import them by name, see tests/multiproc.py).

Each body compares, on its rank, what ``materialize_tensor`` leaves against
eager PyTorch run with the same seed: the local values and the default
generator afterwards.  It returns the list of differences (empty when all is
well) so that the parent test can report every case of every rank at once.
"""

from __future__ import annotations

import torch

from deferinit import deferred_init, is_deferred
from deferinit.materialize import materialize_tensor

# Shapes whose rows or columns do not divide among 4 ranks leave some rank an
# uneven or an empty piece (the empty pieces are made with new_zeros, which
# reads the source only for its geometry).
SHAPES = [(8, 4), (7, 5), (3, 2), (2, 3), (1, 1), (5,)]


def _placements(shape):
    from torch.distributed.tensor import Replicate, Shard

    return [Shard(d) for d in range(len(shape))] + [Replicate()]


def _eager(shape, placement, mesh, src):
    """Eager's local tensor and the generator state it leaves."""
    from torch.distributed.tensor import distribute_tensor

    torch.manual_seed(0)
    local = distribute_tensor(torch.randn(*shape), mesh, [placement], src_data_rank=src)._local_tensor
    return local, torch.get_rng_state()


def case_distribute_generator(rank: int, world_size: int) -> list[str]:
    """distribute_tensor(deferred_init(torch.randn, *shape)) for every placement,
    src_data_rank and shape, the deferred source kept or dropped: after
    materialize_tensor the local tensor and the generator equal eager's; then
    the kept source itself materializes to eager's values without moving the
    generator again."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    problems = []
    for shape in SHAPES:
        torch.manual_seed(0)
        full = torch.randn(*shape)
        for placement in _placements(shape):
            for src in (0, None):
                for keep in (False, True):
                    case = f"rank {rank}: {shape} {placement} src_data_rank={src} source {'kept' if keep else 'dropped'}"
                    expected, after = _eager(shape, placement, mesh, src)
                    torch.manual_seed(0)
                    source = deferred_init(torch.randn, *shape)
                    d = distribute_tensor(source, mesh, [placement], src_data_rank=src)
                    if not keep:
                        del source
                    materialize_tensor(d)
                    if not torch.equal(d._local_tensor, expected):
                        problems.append(f"{case}: local values differ from eager's")
                    if not torch.equal(torch.get_rng_state(), after):
                        problems.append(f"{case}: the generator differs from eager's afterwards")
                    if keep:
                        materialize_tensor(source)
                        if is_deferred(source) or not torch.equal(source, full):
                            problems.append(f"{case}: the kept source differs from eager's")
                        if not torch.equal(torch.get_rng_state(), after):
                            problems.append(f"{case}: materializing the kept source moved the generator")
    return problems
