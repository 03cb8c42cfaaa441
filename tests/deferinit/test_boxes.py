"""deferinit/ir/boxes.py against PyTorch's own views: a strided piece of a tensor is
recognised as a block of its indices exactly when it is one, in order."""

from __future__ import annotations

import random

import torch

from deferinit.ir.boxes import as_box, intersect, slab


def _block(t, start, sizes):
    for d, (i, n) in enumerate(zip(start, sizes)):
        t = t.narrow(d, i, n)
    return t


def test_every_narrowed_view_is_its_block():
    rng = random.Random(0)
    for _ in range(3000):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 4)))
        t = torch.arange(max(1, torch.Size(shape).numel())).reshape(shape)
        start = tuple(rng.randint(0, n - 1) for n in shape)
        sizes = tuple(rng.randint(1, n - i) for n, i in zip(shape, start))
        view = _block(t, start, sizes)
        assert as_box(view.storage_offset(), view.shape, view.stride(), shape) == (start, sizes)


def test_a_box_found_holds_the_same_elements_in_the_same_order():
    rng = random.Random(1)
    found = rejected = 0
    for _ in range(3000):
        shape = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 4)))
        t = torch.arange(torch.Size(shape).numel()).reshape(shape)
        start = tuple(rng.randint(0, n - 1) for n in shape)
        view = _block(t, start, tuple(rng.randint(1, n - i) for n, i in zip(shape, start)))
        if view.is_contiguous() and rng.random() < 0.5:
            view = view.reshape(-1)
        if view.dim() >= 2 and rng.random() < 0.3:
            view = view.transpose(0, 1)
        box = as_box(view.storage_offset(), view.shape, view.stride(), shape)
        if box is None:
            rejected += 1
            continue
        found += 1
        assert torch.equal(_block(t, *box).reshape(-1), view.reshape(-1))
    assert found and rejected


def test_blocks_of_a_column_block():
    """A part of a non-contiguous tensor (the narrow of a padded piece) in its own indices."""
    t = torch.arange(64 * 512).reshape(64, 512)
    piece = t.narrow(1, 0, 511)
    rows = piece[32:]
    assert as_box(rows.storage_offset() - piece.storage_offset(), rows.shape, rows.stride(),
                  piece.shape, piece.stride()) == ((32, 0), (32, 511))
    padding = t.narrow(1, 511, 1)
    assert as_box(padding.storage_offset(), padding.shape, padding.stride(), piece.shape, piece.stride()) is None


def test_slab_and_intersect():
    assert slab(5, (6,), (1,), (3, 4)) == ((1, 0), (2, 4))  # elements 5..10: rows 1 and 2
    assert intersect((0, 0), (2, 4), (1, 2), (5, 5)) == ((1, 2), (1, 2))
    assert intersect((0,), (2,), (2,), (3,)) is None
