"""A picture of the plan (issue 20): the step's memory over time as an SVG or a
self-contained HTML page, and as a memory snapshot PyTorch's memory_viz opens.

Checked by rendering: the SVG and HTML are parsed, PyTorch's
``torch.cuda._memory_viz`` functions run on the snapshot, and the figures
they show are PyTorch's ``MemTracker``'s for the same step (a real run, and
the plan of the same model).
"""

import html
import pickle
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch
import torch.cuda._memory_viz as memory_viz
from torch.distributed._tools.mem_tracker import MemTracker

import clirun
from deferinit import deferred_init
from deferinit.planning.picture import COLUMNS, timeline_html, timeline_svg
from deferinit.planning.report import row_labels
from deferinit.planning.step import LABELS, measure_step
from deferinit.planning.timeline import Timeline
from deferinit.demo import LLAMA_TINY, Llama
from deferinit.text import fmt_bytes
from deferinit.fake import fake_mode

CPU = torch.device("cpu")
SVG = "{http://www.w3.org/2000/svg}"


def _step(model, timeline=None, keep=None):
    ids = torch.randint(0, LLAMA_TINY.vocab_size, (2, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    measured = measure_step(model, (ids,), {}, opt, token_ids=ids, timeline=timeline)
    if keep is not None:
        keep.append(row_labels(model, measured))
    return measured


def _pytorch_memtracker():
    """The same step under PyTorch's own MemTracker alone: peak and end totals."""
    torch.manual_seed(0)
    model = Llama(LLAMA_TINY)
    ids = torch.randint(0, LLAMA_TINY.vocab_size, (2, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        torch.nn.functional.cross_entropy(model(ids).flatten(0, -2).float(), ids.flatten()).backward()
        opt.step()
        opt.zero_grad()
        after = tracker.get_tracker_snapshot()[CPU]["Total"]
    return tracker.get_tracker_snapshot("peak")[CPU]["Total"], after


def _replay(trace) -> tuple[int, int]:
    """Highest and final bytes allocated, replaying a memory_viz device trace."""
    live, top = 0, 0
    for e in trace:
        if e["action"] == "alloc":
            live += e["size"]
        elif e["action"] == "free_completed":
            live -= e["size"]
        top = max(top, live)
    return top, live


@pytest.fixture(scope="module")
def runs():
    """A real run and the plan of the same step, each with its timeline."""
    torch.manual_seed(0)
    real = Timeline()
    _step(Llama(LLAMA_TINY), real)
    torch.manual_seed(0)
    model = deferred_init(Llama, LLAMA_TINY)
    planned = Timeline()
    with fake_mode():
        _step(model, planned, ROWS)
    return real, planned


ROWS = []  # the plan's row_of, for the module band


def test_the_timeline_holds_memtrackers_figures(runs):
    peak, after = _pytorch_memtracker()
    for timeline in runs:
        totals = [t["Total"] for t in timeline.totals(CPU)]
        assert max(totals) == peak and totals[-1] == after
    assert runs[0].events == runs[1].events  # the plan's events are the real run's, one by one


def test_pytorchs_memory_viz_reads_the_snapshot(runs, tmp_path):
    peak, after = _pytorch_memtracker()
    snapshot = runs[1].snapshot()
    path = tmp_path / "plan.pickle"
    path.write_bytes(pickle.dumps(snapshot))
    snapshot = pickle.loads(path.read_bytes())
    trace = snapshot["device_traces"][0]
    assert _replay(trace) == (peak, after)
    assert {e.get("category") for e in trace if e["action"] == "alloc"} >= {"parameters", "gradients",
                                                                            "optimizer state", "activations"}
    assert all(e["frames"] and e["frames"][0]["filename"] for e in trace)
    # PyTorch's own tools on it
    text = memory_viz.segsum(snapshot)
    assert "total_allocated" in text
    assert f"{len(trace)} entries" in memory_viz.trace(snapshot)
    for page in (memory_viz.trace_plot(snapshot), memory_viz.segment_plot(snapshot)):
        assert "snapshot.pickle" in page and "add_local_files" in page
    blocks = [b for seg in snapshot["segments"] for b in seg["blocks"] if b["state"] == "active_allocated"]
    assert sum(b["requested_size"] for b in blocks) == after  # what stays after the step
    r = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", str(path), "-o",
                        str(tmp_path / "trace.html")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "trace.html").read_text().count("base64") == 1


def _parse(svg: str):
    root = ET.fromstring(svg)
    texts = ["".join(t.itertext()) for t in root.iter(SVG + "text")]
    return root, texts


def test_the_svg_draws_the_steps_memory(runs):
    peak, after = _pytorch_memtracker()
    svg = timeline_svg(runs[1], CPU, title="tiny Llama", row_of=ROWS[0])
    root, texts = _parse(svg)
    assert root.tag == SVG + "svg"
    areas = {p.find(SVG + "title").text: p for p in root.iter(SVG + "polygon")}
    assert set(areas) >= {LABELS[c] for c in ("PARAM", "GRAD", "OPT", "ACT")}
    assert any(t.startswith(f"peak {fmt_bytes(peak)} (") for t in texts)
    columns = [r for r in root.iter(SVG + "rect") if r.get("fill") == "transparent"]
    assert 0 < len(columns) <= COLUMNS
    hovers = [c.find(SVG + "title").text for c in columns]
    assert any(h.splitlines()[2] == f"total {fmt_bytes(peak)}" for h in hovers)
    # the stack's top at each column: highest where the peak is, and the peak's height is the axis' scale
    tops = {}
    for poly in areas.values():
        nums = [float(v) for v in re.split(r"[ ,]+", poly.get("points").strip())]
        for x, y in zip(nums[::2], nums[1::2]):
            tops[round(x, 1)] = min(tops.get(round(x, 1), 1e9), y)
    assert min(tops.values()) < max(tops.values())
    assert "stage" in texts and "module" in texts
    assert {"forward", "backward", "optimizer step"} <= set(texts)
    assert any(t.startswith("layers.0-3 (4 x DecoderLayer)") for t in texts) or any(
        "layers.0-3 (4 x DecoderLayer)" in (r.findtext(SVG + "title") or "") for r in root.iter(SVG + "rect"))


def test_the_html_page_is_self_contained(runs):
    page = timeline_html(runs[1], CPU, title="tiny <Llama>", report="report & figures")
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page
    assert "report &amp; figures" in page and "tiny &lt;Llama&gt;" in page
    assert not re.search(r"""(src|href)\s*=\s*["']?https?:""", page)  # nothing loaded from elsewhere
    ET.fromstring(page[page.index("<svg"):page.index("</svg>") + 6])


def test_an_empty_device_is_refused(runs):
    with pytest.raises(ValueError, match="no memory events on cuda:3"):
        timeline_svg(runs[1], torch.device("cuda", 3))


def _plan_cli(*args, cwd):
    # clirun.run sets aside what libraries log as transformers imports them (torchao).
    return clirun.run("plan", *args, cwd=cwd, timeout=600)


def test_plan_writes_the_picture_and_the_snapshot(tmp_path):
    (tmp_path / "targets.py").write_text(
        "from deferinit.demo import Llama, LLAMA_TINY\n\ndef tiny(device=None, dtype=None):\n"
        "    return Llama(LLAMA_TINY, device=device, dtype=dtype)\n")
    r = _plan_cli("targets.py:tiny", "--batch", "2x16", "--shard", "4", "--checkpointing",
                  "--memory-timeline", "step.html", "--memory-snapshot", "step.pickle", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    total = next(line for line in r.stdout.splitlines() if line.strip().startswith("total "))
    peak_text = re.split(r"\s{2,}", total.strip())[1]
    snapshot = pickle.loads((tmp_path / "step.pickle").read_bytes())
    top, _ = _replay(snapshot["device_traces"][0])  # cuda:0
    assert fmt_bytes(top) == peak_text
    page = (tmp_path / "step.html").read_text()
    assert f"peak {peak_text} (" in page and html.escape("rank 0 of 4 (FSDP2, fake process group)") in page
    assert "wrote step.html" in r.stdout and "wrote step.pickle" in r.stdout
    memory_viz.trace_plot(snapshot)


@pytest.mark.parametrize("args, message", [
    (["--memory-timeline", "x.png"], "--memory-timeline 'x.png': the file name must end in .svg or .html"),
    (["--memory-snapshot", "x.json"], "--memory-snapshot 'x.json': the file name must end in .pickle or .pkl"),
    (["--memory-snapshot", "no/such/dir/x.pickle"], "no such directory"),
])
def test_bad_picture_options_are_one_line(tmp_path, args, message):
    r = _plan_cli("deferinit.demo:Llama", "--batch", "1x8", *args, cwd=tmp_path)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1
