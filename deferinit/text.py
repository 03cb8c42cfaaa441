"""Sizes, counts, durations and dtypes as people read them.

One set of helpers for every text the project prints: the inspect table,
the graph view's labels, the demo, progress summaries.

Example::

    >>> fmt_bytes(141 * 2**30), fmt_count(70553706496), fmt_count(70553706496, exact=False)
    ('141.0 GiB', '70,553,706,496 (70.55 B)', '70.6B')
"""

from __future__ import annotations

import torch


def fmt_bytes(n: float) -> str:
    """Bytes in binary units.

    Example::

        >>> fmt_bytes(1536), fmt_bytes(141 * 2**30)
        ('1.5 KiB', '141.0 GiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def fmt_seconds(s: float) -> str:
    """Seconds, in ms below one second.

    Example::

        >>> fmt_seconds(0.0123), fmt_seconds(3.4)
        ('12.3 ms', '3.40 s')
    """
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


_UNITS = (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3))


def fmt_count(n: int, *, exact: bool = True) -> str:
    """A count: with thousands separators and a short form, or (``exact=False``)
    the short form alone, for tight labels.

    Example::

        >>> fmt_count(70553706496), fmt_count(1536, exact=False), fmt_count(12)
        ('70,553,706,496 (70.55 B)', '1.54K', '12')
    """
    for unit, size in _UNITS:
        if n >= size:
            return f"{n:,} ({n / size:.2f} {unit})" if exact else f"{n / size:.3g}{unit}"
    return f"{n:,}" if exact else str(n)


def plural(n: int, word: str) -> str:
    """``n`` and ``word``, with an ``s`` unless ``n`` is 1.

    Example::

        >>> plural(1, "tensor"), plural(3, "op")
        ('1 tensor', '3 ops')
    """
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def dtype_name(dtype: torch.dtype) -> str:
    """The short name of a dtype.

    Example::

        >>> dtype_name(torch.bfloat16)
        'bfloat16'
    """
    return str(dtype).replace("torch.", "")


def tensor_text(t: torch.Tensor) -> str:
    """A constant's values if it is tiny, else its dtype and shape: ``<float32 [3, 4]>``.

    Example::

        >>> tensor_text(torch.tensor([1.0, 2.0])), tensor_text(torch.zeros(3, 4))
        ('[1.0, 2.0]', '<float32 [3, 4]>')
    """
    if t.numel() <= 4 and t.device.type != "meta":
        return repr(t.tolist())
    return f"<{dtype_name(t.dtype)} {list(t.shape)}>"
