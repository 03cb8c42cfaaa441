"""Progress of a materialization: tensors and bytes done of the total, and a summary line.

What is shown is described in docs/materialize.md (``progress=``).  A tensor
is done when the replay has run the last operation it needs, so the counts
are the user's tensors and bytes, not the replayed operations (whose costs
differ by orders of magnitude); while the replay moves past earlier draws
only for the generator's state, the display says how many are left.  It is
refreshed by time: often on a terminal or in Jupyter, every
``LOG_INTERVAL`` seconds in a log, where every refresh stays in the file.
"""

from __future__ import annotations

import os
import sys
import time

from deferinit.ir.liveness import GENERATOR
from deferinit.text import fmt_bytes, fmt_seconds, plural

# Seconds between two refreshes of the display.
TTY_INTERVAL = 0.5
LOG_INTERVAL = 10.0

_OFF = ("", "0", "false", "no", "off")
_told_no_tqdm = False


def progress_wanted(progress) -> bool:
    """``progress`` if given, else whether ``DEFERINIT_PROGRESS`` asks for progress."""
    if progress is None:
        return os.environ.get("DEFERINIT_PROGRESS", "").strip().lower() not in _OFF
    return bool(progress)


def _interactive(file) -> bool:
    try:
        if file.isatty():
            return True
    except (AttributeError, ValueError):
        pass
    # A Jupyter kernel's stderr is a pipe, but the notebook redraws "\r" lines in place.
    return "ipykernel" in sys.modules


def _nbytes(fake) -> int:
    return fake.numel() * fake.element_size()


class Progress:
    """What has been materialized so far, shown on ``file`` (stderr by default).

    ``advance(tensors, nbytes)`` counts tensors done; ``replay_callback(replay,
    fakes)`` gives the per-operation callback of a replay computing ``fakes``;
    ``close(ok)`` ends the display and leaves the summary line (or, on
    failure, a line saying where it stopped).
    """

    def __init__(self, fakes, *, file=None):
        self.file = file if file is not None else sys.stderr
        self.total_tensors = len(fakes)
        self.total_bytes = sum(_nbytes(f) for f in fakes)
        self.tensors = 0
        self.bytes = 0
        # Earlier draws the replays move past only for the generator's state.
        self.earlier = 0
        self.earlier_total = 0
        self.jumped = 0  # draws jumped over
        self.jumped_words = 0
        self.generated = 0  # draws generated into scratch instead (count not known)
        self.start = time.monotonic()
        self.interactive = _interactive(self.file)
        self.interval = TTY_INTERVAL if self.interactive else LOG_INTERVAL
        self._shown = self.start
        self._bar = self._tqdm()
        if self._bar is None:
            self._line()

    def _tqdm(self):
        global _told_no_tqdm
        try:
            from tqdm import tqdm
        except ImportError:
            if not _told_no_tqdm:
                _told_no_tqdm = True
                print("deferinit: progress bars need tqdm (pip install tqdm); "
                      "printing progress lines instead", file=self.file, flush=True)
            return None
        # A terminal's bar gives way to the summary; a log keeps its last state.
        return tqdm(
            total=self.total_bytes, unit="B", unit_scale=True, unit_divisor=1024,
            desc=f"materializing {plural(self.total_tensors, 'tensor')}",
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}B/{total_fmt}B "
                       "[{elapsed}<{remaining}, {rate_fmt}{postfix}]",
            postfix=self._tensors_text(), file=self.file, mininterval=self.interval,
            leave=not self.interactive, dynamic_ncols=True,
        )

    def _tensors_text(self) -> str:
        return f"{self.tensors}/{self.total_tensors} tensors{self._earlier_text()}"

    def _earlier_text(self) -> str:
        if self.earlier >= self.earlier_total:
            return ""
        return f", reaching the generator's state: {self.earlier}/{self.earlier_total} earlier draws"

    def _line(self) -> None:
        print(
            f"deferinit: materializing {plural(self.total_tensors, 'tensor')} "
            f"({fmt_bytes(self.total_bytes)}): {self.tensors} done ({fmt_bytes(self.bytes)}){self._earlier_text()} "
            f"after {fmt_seconds(time.monotonic() - self.start)}",
            file=self.file, flush=True,
        )

    def advance(self, tensors: int, nbytes: int) -> None:
        """``tensors`` more tensors, of ``nbytes`` bytes, are computed."""
        self.tensors += tensors
        self.bytes += nbytes
        self.tick()

    def tick(self) -> None:
        """Redraw if the refresh interval has passed (the time shown moves on too)."""
        now = time.monotonic()
        if now - self._shown < self.interval:
            return
        self._shown = now
        if self._bar is None:
            self._line()
            return
        self._bar.n = self.bytes
        self._bar.set_postfix_str(self._tensors_text(), refresh=False)
        self._bar.refresh()

    def replay_callback(self, replay, fakes):
        """The ``progress(done, total)`` callback for ``replay``, which computes ``fakes``
        (None for a target not counted): a tensor is done once the last
        operation its value needs has run."""
        finishing: dict[int, list] = {}
        at = {id(node): i for i, node in enumerate(replay.plan.order)}
        earlier = {i for i, node in enumerate(replay.plan.order) if node.rng is not None and replay.plan.mode(node) == GENERATOR}
        self.earlier_total += len(earlier)
        for inp, fake in zip(replay.plan.targets, fakes):
            if fake is None:  # computed along, not counted
                continue
            last = inp.version if inp.version is not None else inp.value.node
            entry = finishing.setdefault(at.get(id(last), -1), [0, 0])
            entry[0] += 1
            entry[1] += _nbytes(fake)
        ready = finishing.pop(-1, None)
        if ready:  # served by memory that is already real
            self.advance(*ready)

        def callback(done: int, total: int) -> None:
            if done - 1 in earlier:
                self.earlier += 1
            entry = finishing.get(done - 1)
            if entry is not None:
                self.advance(*entry)
            else:
                self.tick()

        return callback

    def draws_done(self, stats: dict) -> None:
        """A replay ended: count the earlier draws it jumped over or generated
        (``stats`` as :class:`deferinit.materialize.draws.Draws` keeps them)."""
        self.jumped += stats.get("jumped", 0)
        self.jumped_words += stats.get("jumped_words", 0)
        self.generated += stats.get("generated", 0)

    def _draws_text(self) -> str:
        if not self.jumped and not self.generated:
            return ""
        parts = []
        if self.jumped:
            parts.append(f"jumped over {plural(self.jumped, 'earlier draw')} "
                         f"({fmt_bytes(4 * self.jumped_words)} of random numbers)")
        if self.generated:
            parts.append(f"{self.generated} generated" if self.jumped else f"generated {plural(self.generated, 'earlier draw')}")
        return "; the generator " + ", ".join(parts)

    def close(self, ok: bool = True) -> None:
        """End the display; leave one line: the summary, or where a failure stopped it."""
        seconds = time.monotonic() - self.start
        if self._bar is not None:
            self._bar.n = self.bytes
            self._bar.set_postfix_str(self._tensors_text(), refresh=False)
            self._bar.close()
        if ok:
            text = (f"deferinit: materialized {plural(self.total_tensors, 'tensor')} "
                    f"({fmt_bytes(self.total_bytes)}) in {fmt_seconds(seconds)}{self._draws_text()}")
        else:
            text = (f"deferinit: materialization stopped after {fmt_seconds(seconds)}, "
                    f"{self.tensors} of {self.total_tensors} tensors computed; nothing was changed")
        print(text, file=self.file, flush=True)


def start_progress(progress, fakes) -> Progress | None:
    """A :class:`Progress` over ``fakes`` if progress is wanted (see :func:`progress_wanted`), else None."""
    if not progress_wanted(progress) or not fakes:
        return None
    return Progress(fakes)
