"""The MT19937 jump-ahead (deferinit/random/mt19937.py) against torch's own CPU generator.

The characteristic polynomial is computed again by Berlekamp-Massey from
the generator's real outputs; every jump is compared with the state that
drawing the same number of words reaches.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deferinit.random import mt19937
from deferinit.random.mt19937 import DEGREE, PHI, advance, jump_polynomial


def berlekamp_massey(bits) -> tuple[int, int]:
    """``(connection polynomial, length)`` of the shortest LFSR making ``bits``
    (bit i of the polynomial: the coefficient of x**i)."""
    c, b, length, m, window = 1, 1, 0, 1, 0
    for n, s in enumerate(bits):
        window = (window << 1) | s
        if not (c & window).bit_count() & 1:
            m += 1
        elif 2 * length <= n:
            c, b, length, m = c ^ (b << m), c, n + 1 - length, 1
        else:
            c ^= b << m
            m += 1
    return c, length


def test_characteristic_polynomial_is_the_real_generators():
    """Bit 0 of torch's outputs (random_ over 2**24: one word each, its low 24
    bits) obeys a recurrence of degree 19937 whose polynomial is PHI."""
    g = torch.Generator().manual_seed(12345)
    words = torch.empty(2 * DEGREE + 100, dtype=torch.int64).random_(0, 1 << 24, generator=g)
    bits = (words & 1).tolist()
    c, length = berlekamp_massey(bits)
    assert length == DEGREE
    phi = int(format(c, f"0{length + 1}b")[::-1], 2)  # the reciprocal: t**L * C(1/t)
    assert phi == PHI and PHI.bit_count() == 135


def drawn(state: torch.Tensor, words: int) -> torch.Tensor:
    g = torch.Generator()
    g.set_state(state)
    torch.empty(words, dtype=torch.int32).random_(generator=g)  # one word each
    return g.get_state()


@pytest.mark.parametrize("warm", [0, 1, 5, 623, 624, 625, 1000])
@pytest.mark.parametrize("words", [0, 1, 2, 622, 623, 624, 625, 1247, 1248, 1249, 19936, 19937, 20000, 65535, 65536, 70001, 624 * 64 * 3 + 5, 2_000_003])
def test_advance_equals_drawing(warm, words):
    g = torch.Generator().manual_seed(warm + 7)
    torch.empty(warm, dtype=torch.int32).random_(generator=g)
    start = g.get_state()
    assert torch.equal(advance(start, words), drawn(start, words))


def test_long_jumps_equal_drawing_and_compose():
    g = torch.Generator().manual_seed(3)
    torch.rand(321, generator=g)
    start = g.get_state()
    n = 30_000_017
    assert torch.equal(advance(start, n), drawn(start, n))
    a, b = 10**12 + 3, 987_654_321_987
    assert torch.equal(advance(advance(start, a), b), advance(start, a + b))


def test_jumps_from_a_fresh_seed_keep_everything_but_the_words():
    g = torch.Generator().manual_seed(99)
    start = g.get_state()  # left == 1: the first draw refills
    after = advance(start, 5_000_000)
    assert torch.equal(after, drawn(start, 5_000_000))
    assert torch.equal(after[:8], start[:8])  # the seed
    assert torch.equal(after[5016:], start[5016:])  # the cached normal samples


def test_jump_polynomial_is_a_power_of_t():
    # t**(a+b) = t**a * t**b mod phi, checked by the slow exact product.
    a, b = 123_456_789, 987_654
    ga, gb = jump_polynomial(a), jump_polynomial(b)
    product = mt19937._clmul_exact(ga, gb)
    remainder = product
    while remainder.bit_length() > DEGREE:
        remainder ^= PHI << (remainder.bit_length() - 1 - DEGREE)
    assert remainder == jump_polynomial(a + b)
    assert jump_polynomial(DEGREE) == PHI ^ (1 << DEGREE)


def test_extend_continues_torchs_refills():
    g = torch.Generator().manual_seed(0)
    block = mt19937.state_words(g.get_state())
    words = mt19937.extend(block, 4 * 624)
    for b in range(1, 4):
        torch.empty(624, dtype=torch.int32).random_(generator=g)
        assert np.array_equal(words[624 * b:624 * (b + 1)], mt19937.state_words(g.get_state()))


def test_a_negative_jump_is_refused():
    with pytest.raises(ValueError):
        advance(torch.Generator().get_state(), -1)
