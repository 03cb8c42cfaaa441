"""Progress of a materialization (issue 14, item 2), seen as a user sees it.

The scripts run in a subprocess with stderr piped, as under Jupyter, SLURM or
``2> log``: progress must show when asked for, count tensors and bytes of the
model (computed here from the eager model, not from the toolkit), and leave
a one-line summary.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

from deferinit import deferred_init
from deferinit.text import fmt_bytes
from deferinit.materialize import materialize_module, progress as progress_module

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUMMARY = re.compile(r"^deferinit: materialized (\d+) tensors \(([^)]+)\) in [\d.]+ m?s(?:; the generator [^\n]*)?$", re.M)

# A model whose tensors the test counts from the eager twin.
SCRIPT = """
import sys, torch, torch.nn as nn
from deferinit import deferred_init, is_deferred
from deferinit.materialize import materialize_module

def build():
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range({layers})], nn.LayerNorm(64))

torch.manual_seed(0)
eager = build()
torch.manual_seed(0)
m = deferred_init(build)
materialize_module(m{kwargs})
assert not is_deferred(m)
assert all(torch.equal(a, b) for a, b in zip(eager.state_dict().values(), m.state_dict().values()))
tensors = list(eager.state_dict().values())
print(len(tensors), sum(t.numel() * t.element_size() for t in tensors))
"""


def _run(script: str, env_extra=None, prelude: str = ""):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEFERINIT_PROGRESS")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra or {})
    proc = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(script)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    count, nbytes = map(int, proc.stdout.split())
    return proc.stderr, count, nbytes


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_progress_shows_on_piped_stderr_with_a_summary(how):
    pytest.importorskip("tqdm")
    kwargs, env = (", progress=True", None) if how == "argument" else ("", {"DEFERINIT_PROGRESS": "1"})
    err, count, nbytes = _run(SCRIPT.format(layers=20, kwargs=kwargs), env)
    assert f"materializing {count} tensors" in err          # the bar, in the model's units
    assert re.search(r"[\d.]+[kMG]?B/[\d.]+[kMG]?B ", err)   # bytes done of the total
    summaries = SUMMARY.findall(err)
    assert summaries == [(str(count), fmt_bytes(nbytes))], err
    assert err.rstrip("\n").splitlines()[-1].startswith("deferinit: materialized")


@pytest.mark.parametrize("env", [{}, {"DEFERINIT_PROGRESS": "0"}])
def test_no_progress_unless_asked(env):
    err, _, _ = _run(SCRIPT.format(layers=20, kwargs=""), env)
    assert "materializ" not in err


def test_progress_false_overrides_the_environment():
    err, _, _ = _run(SCRIPT.format(layers=20, kwargs=", progress=False"), {"DEFERINIT_PROGRESS": "1"})
    assert "materializ" not in err


def test_refreshed_by_time_not_by_operations():
    """200 tensors, ~400 operations, replayed in well under the refresh interval of a
    log: the display is drawn at the start and not redrawn every few operations."""
    pytest.importorskip("tqdm")
    err, count, _ = _run(SCRIPT.format(layers=100, kwargs=", progress=True"))
    assert count == 202
    states = re.findall(r"(\d+)/202 tensors", err)
    assert 1 <= len(states) <= 3, err   # start, perhaps one refresh, not one per 64 ops
    assert SUMMARY.search(err)


def test_without_tqdm_it_says_so_once_and_still_shows_progress():
    script = SCRIPT.format(layers=20, kwargs=", progress=True") + textwrap.dedent("""
        torch.manual_seed(0)
        m2 = deferred_init(build)
        materialize_module(m2, progress=True)
    """)
    err, count, nbytes = _run(script, prelude="import sys; sys.modules['tqdm'] = None\n")
    assert err.count("need tqdm") == 1, err
    assert len(re.findall(rf"deferinit: materializing {count} tensors", err)) == 2
    assert SUMMARY.findall(err) == [(str(count), fmt_bytes(nbytes))] * 2


def test_counts_tensors_as_they_are_done(monkeypatch):
    """Redrawn at every completion (interval 0): the tensors and bytes done grow to
    the totals of the eager model."""
    pytest.importorskip("tqdm")
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    monkeypatch.setattr(progress_module, "LOG_INTERVAL", 0.0)

    def build():
        return nn.Sequential(nn.Embedding(100, 16), nn.Linear(16, 32), nn.BatchNorm1d(32))

    torch.manual_seed(0)
    eager = build()
    torch.manual_seed(0)
    m = deferred_init(build)
    materialize_module(m, progress=True)
    tensors = list(eager.state_dict().values())
    n = len(tensors)
    done = [int(x) for x in re.findall(rf"(\d+)/{n} tensors", stream.getvalue())]
    assert done == sorted(done) and done[0] == 0 and len(set(done)) > 2
    assert SUMMARY.findall(stream.getvalue()) == [
        (str(n), fmt_bytes(sum(t.numel() * t.element_size() for t in tensors)))
    ]


def test_on_a_terminal_the_bar_gives_way_to_the_summary(monkeypatch):
    pytest.importorskip("tqdm")
    stream = io.StringIO()
    stream.isatty = lambda: True
    monkeypatch.setattr(sys, "stderr", stream)
    torch.manual_seed(0)
    m = deferred_init(nn.Linear, 8, 8)
    materialize_module(m, progress=True)
    text = stream.getvalue()
    assert "materializing 2 tensors" in text
    last = text.rsplit("\r", 1)[1]
    assert SUMMARY.fullmatch(last.strip()) and SUMMARY.match(last.strip()).groups() == ("2", fmt_bytes(72 * 4))


def test_a_failed_materialization_says_where_it_stopped(monkeypatch):
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    outside = torch.ones(3)

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.randn(3))
            self.b = nn.Parameter(torch.randn(3) * outside)

    m = deferred_init(Scaled)
    outside.add_(1)
    with pytest.raises(Exception, match="modified in place"):
        materialize_module(m, progress=True)
    assert "stopped after" in stream.getvalue() and "nothing was changed" in stream.getvalue()
    assert not SUMMARY.search(stream.getvalue())


def test_a_part_says_how_it_reaches_the_generators_state(monkeypatch):
    """Materializing the last layer of a deferred model moves the generator past
    every earlier layer's draws: the display counts them while it does, and the
    summary says they were jumped over (the ones whose count is not known,
    here trunc_normal_'s, generated)."""
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    monkeypatch.setattr(progress_module, "LOG_INTERVAL", 0.0)
    monkeypatch.setattr(progress_module, "_told_no_tqdm", True)
    monkeypatch.setitem(sys.modules, "tqdm", None)  # the plain lines show every refresh

    def build():
        layers = []
        for i in range(6):
            layers.append(nn.Linear(32, 32))
            if i == 1:
                nn.init.trunc_normal_(layers[1].weight, std=0.02)
        return nn.Sequential(*layers)

    torch.manual_seed(0)
    eager = build()
    torch.manual_seed(0)
    m = deferred_init(build)
    materialize_module(m[5], progress=True)
    assert torch.equal(m[5].weight, eager[5].weight) and torch.equal(m[5].bias, eager[5].bias)
    text = stream.getvalue()
    counts = [(int(a), int(b)) for a, b in re.findall(r"(\d+)/(\d+) earlier draws", text)]
    assert counts == sorted(counts) and all(b == 11 for _, b in counts) and len({a for a, _ in counts}) > 2
    summary = text.rstrip("\n").splitlines()[-1]
    assert SUMMARY.fullmatch(summary), summary
    assert "the generator jumped over 10 earlier draws (" in summary and "1 generated" in summary
