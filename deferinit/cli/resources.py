"""Resident memory of this process, as the command line and the demo report it."""

from __future__ import annotations

import os
import resource
import sys


def peak_rss_bytes() -> int:
    """The peak resident memory of this process so far, in bytes.

    Example::

        >>> peak_rss_bytes() >= rss_bytes()
        True
    """
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def rss_bytes() -> int:
    """The resident memory of this process now (Linux; elsewhere the peak), in bytes.

    Example::

        >>> before = rss_bytes(); m = deferred_init(Llama, LLAMA_70B); rss_bytes() - before < 2**30
        True
    """
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()
