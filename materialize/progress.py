"""Progress of a materialization: an optional tqdm bar."""

from __future__ import annotations

import os
import sys

# Materializations of at least this many tensors may show a progress bar.
PROGRESS_MIN_TENSORS = 16


class _Bar:
    """A tqdm bar over the replayed operations."""

    def __init__(self, total_tensors):
        from tqdm import tqdm

        self._bar = tqdm(total=None, desc=f"materializing {total_tensors} tensors", unit="op", leave=False)

    def update_to(self, done, total):
        if self._bar.total != total:
            self._bar.total = total
        self._bar.n = done
        if done == total or done % 64 == 0:
            self._bar.refresh()

    def close(self):
        self._bar.close()


def progress_bar(progress, n_tensors):
    if progress is None:
        progress = os.environ.get("DEFERINIT_PROGRESS", "") not in ("", "0")
    if not progress or n_tensors < PROGRESS_MIN_TENSORS or not sys.stderr.isatty():
        return None
    try:
        return _Bar(n_tensors)
    except ImportError:
        return None
