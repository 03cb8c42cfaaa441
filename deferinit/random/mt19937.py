"""The CPU generator's Mersenne Twister as GF(2) algebra: its state after N more words, in time growing with log N.

Every CPU ``torch.Generator`` is an MT19937 (ATen's ``mt19937_engine``):
624 words, refilled a block at a time, each output one tempered word.
The step from one state to the next is linear over GF(2), so N steps are
a polynomial in that step: ``t**N mod phi``, where ``phi`` is the
characteristic polynomial (degree 19937, 135 terms; :data:`PHI`).
Evaluating that polynomial on a state is a XOR of windows of the word
sequence the state starts (Haramoto, Matsumoto, Nishimura, Panneton,
L'Ecuyer, "Efficient jump ahead for F2-linear random number generators",
INFORMS J. on Computing 20(3), 2008).  Polynomials are Python ints (bit i
the coefficient of ``t**i``); squaring spreads the bits, reduction is a
Barrett step whose one dense product goes through numpy's FFT (exact:
coefficients stay below 2**15, and a product that does not round cleanly
is recomputed with integers).

:func:`advance` works on the generator state torch's ``get_state`` gives
(5056 bytes: seed, ``left``, ``seeded``, ``next``, the 624 words as
uint64, the cached normal samples); it changes only the words, ``left``
and ``next``, exactly as drawing N words would.

Example::

    >>> g = torch.Generator().manual_seed(3)
    >>> after = advance(g.get_state(), 10**12)          # a terabyte of floats, not drawn
    >>> _ = g.set_state(advance(g.get_state(), 5)); _ = torch.rand(1, generator=g)
    >>> torch.equal(g.get_state(), advance(torch.Generator().manual_seed(3).get_state(), 6))
    True
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from deferinit.fake.bypass import no_python_dispatch

N = 624  # words of state
M = 397
DEGREE = 19937  # of the characteristic polynomial (the period is 2**19937 - 1)

_UPPER = np.uint32(0x80000000)
_LOWER = np.uint32(0x7FFFFFFF)
_MATRIX_A = np.uint32(0x9908B0DF)

# Byte offsets in torch's CPU generator state (ATen/CPUGeneratorImpl.cpp,
# CPUGeneratorImplState: the legacy THGeneratorState, then the float normal
# sample): the seed (uint64), left (int32), seeded (int32), next (uint64),
# the 624 words (uint64 each), normal_x, normal_y, normal_rho (double),
# normal_is_valid (int32), next_float_normal_sample (float), its flag (bool).
_LEFT = 8
_NEXT = 16
_WORDS = 24
NORMAL_Y = 5024  # the cached double normal sample
NORMAL_VALID = 5040

#: Exponents of the characteristic polynomial of MT19937's one-word step:
#: ``phi(t) = sum(t**e for e in PHI_EXPONENTS)``.  Computed by
#: Berlekamp-Massey from real outputs; tests/deferinit/test_mt19937.py
#: computes it again from torch's generator.
PHI_EXPONENTS = (
    0, 1189, 1416, 1585, 1643, 1870, 2493, 2773, 3000, 3227, 3454, 3681, 3908, 4135, 4362, 4753, 5661, 6337,
    6569, 7129, 7477, 7525, 7583, 7752, 7979, 8206, 9505, 9901, 9969, 10128, 10693, 10761, 10920, 11089,
    11147, 11157, 11215, 11321, 11374, 11384, 11485, 11611, 11712, 11717, 11838, 11881, 11944, 11997, 12277,
    12335, 12393, 12504, 12509, 12620, 12673, 12731, 12736, 12789, 12905, 12958, 12963, 13137, 13185, 13190,
    13243, 13301, 13412, 13528, 13533, 13639, 13697, 13760, 13813, 13866, 14093, 14151, 14209, 14320, 14325,
    14436, 14547, 14552, 14605, 14721, 14774, 14779, 14953, 15001, 15006, 15059, 15117, 15228, 15344, 15349,
    15455, 15513, 15576, 15629, 15682, 15909, 15967, 16025, 16136, 16141, 16252, 16363, 16368, 16421, 16537,
    16590, 16595, 16817, 16822, 16875, 16933, 17044, 17160, 17271, 17329, 17445, 17498, 17725, 17783, 17841,
    17952, 18068, 18179, 18237, 18406, 18633, 18691, 18860, 19087, 19314, 19937,
)
PHI = sum(1 << e for e in PHI_EXPONENTS)

# Jumps shorter than this many words are drawn instead (the block refills
# of a short extension cost less than a jump).
EXTEND_BELOW = 1 << 16
_ROUND = 64


# -- the word sequence --------------------------------------------------------


def extend(block: np.ndarray, count: int) -> np.ndarray:
    """The first ``count`` words of the sequence whose first 624 are ``block``
    (untempered: the state words themselves, block after block as refills make them).

    Example::

        >>> g = torch.Generator().manual_seed(0)
        >>> words = extend(state_words(g.get_state()), 2 * N)
        >>> _ = torch.rand(1, generator=g)                  # the first draw refills
        >>> bool((words[N:] == state_words(g.get_state())).all())
        True
    """
    out = np.empty(max(count, N), np.uint32)
    out[:N] = block
    # x[k] = x[k-227] ^ twist(x[k-624], x[k-623]): 227 words at a time depend
    # only on words already made.
    step = N - M
    for start in range(N, count, step):
        end = min(start + step, count)
        v = out[start - N + 1:end - N + 1]
        y = (out[start - N:end - N] & _UPPER) | (v & _LOWER)
        out[start:end] = out[start - step:end - step] ^ (y >> 1) ^ ((v & 1) * _MATRIX_A)
    return out[:count]


def state_words(state: torch.Tensor) -> np.ndarray:
    """The 624 words of a CPU generator state (``get_state()``)."""
    raw = state.numpy() if isinstance(state, torch.Tensor) else state
    return np.frombuffer(raw.tobytes(), np.uint64, N, _WORDS).astype(np.uint32)


# -- GF(2) polynomials -------------------------------------------------------

_SPREAD = np.array([sum(((b >> i) & 1) << (2 * i) for i in range(8)) for b in range(256)], np.uint16)


def _square(a: int) -> int:
    """``a**2`` over GF(2): bit i moves to bit 2i."""
    raw = np.frombuffer(a.to_bytes((a.bit_length() + 7) // 8 or 1, "little"), np.uint8)
    return int.from_bytes(_SPREAD[raw].astype("<u2").tobytes(), "little")


def _bits(a: int, n: int) -> np.ndarray:
    raw = np.frombuffer(a.to_bytes((n + 7) // 8, "little"), np.uint8)
    return np.unpackbits(raw, bitorder="little")[:n]


def _from_bits(bits: np.ndarray) -> int:
    return int.from_bytes(np.packbits(bits, bitorder="little").tobytes(), "little")


def _clmul_exact(a: int, b: int) -> int:
    """Carry-less product, slowly (the check of the FFT product)."""
    out = 0
    while b:
        low = b & -b
        out ^= a << (low.bit_length() - 1)
        b ^= low
    return out


class _Barrett:
    """Reduction modulo :data:`PHI`: ``r = p - floor(floor(p / t**d) * mu / t**d) * phi``."""

    def __init__(self):
        d = DEGREE
        # mu = floor(t**(2d) / phi), by long division (once per process).
        rem, mu = 1 << (2 * d), 0
        while rem.bit_length() > d:
            shift = rem.bit_length() - 1 - d
            mu |= 1 << shift
            rem ^= PHI << shift
        self.size = 1 << (2 * d + 2).bit_length()
        self.mu_fft = np.fft.rfft(_bits(mu, d + 1).astype(np.float64), self.size)
        self.mu = mu

    def reduce(self, p: int) -> int:
        d = DEGREE
        high = p >> d
        if not high:
            return p
        product = np.fft.irfft(np.fft.rfft(_bits(high, d).astype(np.float64), self.size) * self.mu_fft, self.size)
        rounded = np.rint(product)
        if np.abs(product - rounded).max() > 0.25:  # never seen; exactness first
            q = _clmul_exact(high, self.mu) >> d
        else:
            q = _from_bits((rounded[d:2 * d + 1].astype(np.int64) & 1).astype(np.uint8))
        qphi = 0
        for e in PHI_EXPONENTS:
            qphi ^= q << e
        r = p ^ qphi
        if r >> d:  # Barrett over a field is exact; keep it honest
            raise AssertionError("MT19937 jump: reduction failed")
        return r


_barrett: _Barrett | None = None
_lock = threading.Lock()
_cache: dict = {}  # J -> t**J mod phi, the last few jumps (sharded ranks repeat theirs)
_CACHE_SIZE = 64


def jump_polynomial(j: int) -> int:
    """``t**j mod phi``: the polynomial of ``j`` one-word steps.

    Example::

        >>> jump_polynomial(5) == 1 << 5
        True
    """
    global _barrett
    if j < DEGREE:
        return 1 << j
    with _lock:
        found = _cache.get(j)
        if found is not None:
            return found
        if _barrett is None:
            _barrett = _Barrett()
        barrett = _barrett
    # Left to right: square, and shift for every one bit of j (squares of
    # short powers need no reduction).
    g = 1
    for i in range(j.bit_length() - 1, -1, -1):
        g = barrett.reduce(_square(g))
        if (j >> i) & 1:
            g <<= 1
            if g >> DEGREE:
                g ^= PHI
    with _lock:
        if len(_cache) >= _CACHE_SIZE:
            _cache.pop(next(iter(_cache)))
        _cache[j] = g
    return g


def _apply(g: int, block: np.ndarray) -> np.ndarray:
    """The 624-word window ``g(F)`` makes of the window ``block`` (F: one word's
    step), i.e. ``XOR of the windows starting at i`` for every term ``t**i`` of ``g``.
    The lower 31 bits of the first word are not part of the state."""
    x = extend(block, DEGREE + N - 1)
    windows = np.lib.stride_tricks.sliding_window_view(x, N)
    terms = np.flatnonzero(_bits(g, DEGREE))
    out = np.zeros(N, np.uint32)
    # 24 windows at a time (60 KB): in cache, and below the size from which
    # malloc may hand each gather fresh pages (MALLOC_MMAP_THRESHOLD_ set low,
    # as memory-minded runs do, made 1024 at a time six times slower).
    for start in range(0, len(terms), 24):
        out ^= np.bitwise_xor.reduce(windows[terms[start:start + 24]], axis=0)
    return out


def jump_block(block: np.ndarray, refills: int) -> np.ndarray:
    """The block ``refills`` refills after ``block`` (words 624*refills .. +623 of its sequence)."""
    if refills == 0:
        return block.copy()
    end = N * refills + N
    if end <= EXTEND_BELOW:
        return extend(block, end)[end - N:]
    # Jump by a multiple of _ROUND refills (jumps of nearly the same length,
    # as a sharded rank makes from one parameter to the next, then share one
    # cached polynomial), then extend by the rest.
    jumped = refills - refills % _ROUND
    # Jump to the window one word early: its first word is the only one
    # whose lower bits the state does not hold.
    j = N * jumped - 1
    w = _apply(jump_polynomial(j), block)
    out = np.empty(N, np.uint32)
    out[:N - 1] = w[1:]
    # The last word: x[j+624] = x[j+397] ^ twist(x[j], x[j+1]).
    y = (w[0] & _UPPER) | (w[1] & _LOWER)
    out[N - 1] = w[M] ^ (y >> 1) ^ ((w[1] & 1) * _MATRIX_A)
    rest = refills - jumped
    return extend(out, N * rest + N)[N * rest:] if rest else out


def _refills(state: torch.Tensor, words: int) -> int:
    """How many block refills drawing ``words`` words from ``state`` makes."""
    left = int.from_bytes(state[_LEFT:_LEFT + 4].numpy().tobytes(), "little", signed=True)
    rest = words - (left - 1)
    return -(-rest // N) if rest > 0 else 0


def jump_is_cheap(state: torch.Tensor, words: int) -> bool:
    """Whether :func:`advance` by ``words`` needs no new polynomial (one cached,
    or no jump at all): it then costs a few milliseconds, not tens."""
    refills = _refills(state, words)
    if N * refills + N <= EXTEND_BELOW:
        return True
    jumped = refills - refills % _ROUND
    j = N * jumped - 1
    return j < DEGREE or j in _cache


def advance(state: torch.Tensor, words: int) -> torch.Tensor:
    """The CPU generator state after ``words`` more 32-bit outputs, as a new tensor;
    nothing but the words, ``left`` and ``next`` changes (the cached normal
    samples are the kernels' business).

    Example::

        >>> g = torch.Generator().manual_seed(1)
        >>> expected = advance(g.get_state(), 1000)
        >>> _ = torch.rand(1000, generator=g)   # float32: one word per element
        >>> torch.equal(g.get_state(), expected)
        True
    """
    if words < 0:
        raise ValueError(f"cannot advance a generator by {words} words")
    raw = bytearray(state.numpy().tobytes())
    if words == 0:
        return _tensor(raw)
    left = int.from_bytes(raw[_LEFT:_LEFT + 4], "little", signed=True)
    nxt = int.from_bytes(raw[_NEXT:_NEXT + 8], "little")
    in_block = left - 1  # outputs left before the next refill
    if words <= in_block:
        left -= words
        nxt += words
    else:
        rest = words - in_block
        refills = -(-rest // N)
        used = rest - N * (refills - 1)
        block = jump_block(np.frombuffer(bytes(raw[_WORDS:_WORDS + 8 * N]), np.uint64).astype(np.uint32), refills)
        raw[_WORDS:_WORDS + 8 * N] = block.astype("<u8").tobytes()
        left = N + 1 - used
        nxt = used
    raw[_LEFT:_LEFT + 4] = left.to_bytes(4, "little", signed=True)
    raw[_NEXT:_NEXT + 8] = nxt.to_bytes(8, "little")
    return _tensor(raw)


def _tensor(raw: bytearray) -> torch.Tensor:
    """A state tensor of ``raw``'s bytes (a real one, whatever mode is active)."""
    with no_python_dispatch():
        return torch.frombuffer(raw, dtype=torch.uint8).clone()


def normal_cache(state: torch.Tensor) -> bool:
    """Whether the state holds a cached double normal sample (the second of a
    Box-Muller pair, served to the next element of a per-element ``normal_``)."""
    raw = state.numpy()
    return bool(int.from_bytes(raw[NORMAL_VALID:NORMAL_VALID + 4].tobytes(), "little"))


def without_normal_cache(state: torch.Tensor) -> torch.Tensor:
    """``state`` with its cached double normal sample used up (as a per-element
    ``normal_`` leaves it after taking the sample)."""
    raw = bytearray(state.numpy().tobytes())
    raw[NORMAL_Y:NORMAL_Y + 8] = bytes(8)
    raw[NORMAL_VALID:NORMAL_VALID + 4] = bytes(4)
    return _tensor(raw)
