"""A picture of the step's memory over time: an SVG, or a self-contained HTML page.

The picture shows what PyTorch's memory visualizer shows for a real run,
from a :class:`~deferinit.planning.timeline.Timeline`: one device's memory
after each update of the tracker, stacked by category (parameters,
gradients, optimizer state, activations, temporaries...), with the stage
of the step (forward, backward, optimizer step) and the module running
in two bands below it, and the peak marked.  Long steps are drawn as an
envelope: each of at most :data:`COLUMNS` columns shows the highest moment
of the events it covers, so the peak is never smoothed away.  Hovering a
column shows its figures (SVG ``<title>``); nothing is loaded from
elsewhere.
"""

from __future__ import annotations

import html

from ..text import fmt_bytes
from .step import LABELS

#: The most columns a picture has.
COLUMNS = 900

_COLORS = {
    "PARAM": "#4e79a7", "SHARDED_PARAM": "#4e79a7", "UNSHARDED_PARAM": "#a0cbe8", "BUFFER": "#86bcb6",
    "GRAD": "#f28e2b", "SHARDED_GRAD": "#f28e2b", "UNSHARDED_GRAD": "#ffbe7d", "OPT": "#59a14f",
    "ACT": "#e15759", "TEMP": "#b07aa1", "INP": "#9c755f", "ALL_GATHER": "#76b7b2",
    "REDUCE_SCATTER": "#edc948", "OTH": "#bab0ac",
}
_STAGE_COLORS = ("#dfe7f2", "#f6e3d2", "#e2eedd", "#eee4ee", "#f3efd5")
_BAND_COLORS = ("#c9d7ea", "#e9d3bd", "#cfe2c8", "#e2d1e2", "#ebe4bd", "#d3e5e3")
_W, _LEFT, _RIGHT, _TOP, _CHART_H, _BAND_H = 1200, 84, 210, 46, 380, 22


def _columns(totals: list[dict], events: list[tuple], row_of) -> list[tuple]:
    """``(first, last, totals, stage, row)`` per column: the highest moment of its events."""
    n = len(totals)
    count = min(n, COLUMNS)
    out = []
    for j in range(count):
        a, b = j * n // count, max((j + 1) * n // count, j * n // count + 1)
        best = max(range(a, b), key=lambda i: totals[i]["Total"])
        event = events[best]
        out.append((a, b - 1, totals[best], event[7], row_of(event[6])))
    return out


def _nice_step(top: float) -> float:
    """A grid step for an axis up to ``top`` bytes: 1, 2 or 5 x 2**(10k) x 10**j, about five lines."""
    unit = 1
    while unit * 1024 <= top:
        unit *= 1024
    raw = top / unit / 5 or 1
    power = 1.0
    while power * 10 <= raw:
        power *= 10
    while power > raw:
        power /= 10
    return unit * next(f * power for f in (1, 2, 5, 10) if f * power >= raw)


def _runs(values: list) -> list[tuple[int, int, object]]:
    """``(start, end, value)`` of each run of equal values."""
    runs, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            runs.append((start, i, values[start]))
            start = i
    return runs


def _text(x, y, s, size=11, anchor="start", weight="normal", fill="#222") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" font-weight="{weight}" '
            f'fill="{fill}">{html.escape(str(s))}</text>')


def timeline_svg(timeline, device, *, title: str = "", subtitle: str = "", row_of=None) -> str:
    """The memory of ``device`` over the step recorded in ``timeline``, as an SVG document.

    ``row_of(module_name)`` gives the label of the module band (default: the
    module's name without the root's); ``title`` and ``subtitle`` head it.
    A device without events in ``timeline`` raises ValueError.

    Example::

        >>> from deferinit.planning import Timeline, measure_step
        >>> timeline, model = Timeline(), torch.nn.Linear(64, 64)
        >>> _ = measure_step(model, (torch.randn(8, 64),), {}, torch.optim.SGD(model.parameters()), timeline=timeline)
        >>> svg = timeline_svg(timeline, torch.device("cpu"), title="Linear(64, 64)")
        >>> svg.startswith("<svg") and "peak" in svg
        True
    """
    row_of = row_of or (lambda name: name.partition(".")[2] or name or "(outside any module)")
    events = [e for e in timeline.events if e[1] == device]
    totals = list(timeline.totals(device))
    if not totals:
        raise ValueError(f"the timeline has no memory events on {device}")
    cols = _columns(totals, events, row_of)
    cats = [c for c in LABELS if any(col[2].get(c) for col in cols)]
    top = max(col[2]["Total"] for col in cols) or 1
    step = _nice_step(top)
    ymax = step * -(-top // step)
    width = _W - _LEFT - _RIGHT
    dx = width / len(cols)
    bottom = _TOP + _CHART_H

    def y(v):
        return bottom - _CHART_H * v / ymax

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{bottom + 2 * _BAND_H + 70}" '
             f'viewBox="0 0 {_W} {bottom + 2 * _BAND_H + 70}" font-family="Helvetica, Arial, sans-serif">',
             f'<rect width="100%" height="100%" fill="white"/>',
             _text(_LEFT, 20, title or "memory over one training step", 15, weight="bold"),
             _text(_LEFT, 37, subtitle or f"{device}: memory counted by PyTorch's memory tracker, by category", 11,
                   fill="#555")]
    t = 0.0
    while t <= ymax + 1e-9:  # grid and y axis
        parts.append(f'<line x1="{_LEFT}" x2="{_LEFT + width}" y1="{y(t):.1f}" y2="{y(t):.1f}" stroke="#e4e4e4"/>')
        parts.append(_text(_LEFT - 6, y(t) + 4, fmt_bytes(t), 10, anchor="end", fill="#555"))
        t += step
    below = [0.0] * len(cols)
    for cat in cats:  # stacked areas, bottom up
        above = [b + max(col[2].get(cat, 0), 0) for b, col in zip(below, cols)]
        upper = " ".join(f"{_LEFT + i * dx:.1f},{y(v):.1f} {_LEFT + (i + 1) * dx:.1f},{y(v):.1f}" for i, v in enumerate(above))
        lower = " ".join(f"{_LEFT + (i + 1) * dx:.1f},{y(v):.1f} {_LEFT + i * dx:.1f},{y(v):.1f}"
                         for i, v in reversed(list(enumerate(below))))
        parts.append(f'<polygon points="{upper} {lower}" fill="{_COLORS.get(cat, "#999")}" stroke="none">'
                     f'<title>{html.escape(LABELS[cat])}</title></polygon>')
        below = above
    peak_i = max(range(len(cols)), key=lambda i: cols[i][2]["Total"])
    px = _LEFT + (peak_i + 0.5) * dx
    parts.append(f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{_TOP}" y2="{bottom}" stroke="#222" stroke-dasharray="4 3"/>')
    peak = cols[peak_i]
    anchor = "end" if peak_i > len(cols) * 0.6 else "start"
    parts.append(_text(px + (-5 if anchor == "end" else 5), _TOP + 12,
                       f"peak {fmt_bytes(peak[2]['Total'])} ({peak[3]}, {peak[4]})", 11, anchor=anchor, weight="bold"))
    for i, (a, b, tot, stage, row) in enumerate(cols):  # hover areas
        lines = [f"events {a}-{b}" if b > a else f"event {a}", f"{stage}; {row}", f"total {fmt_bytes(tot['Total'])}"]
        lines += [f"{LABELS[c]}: {fmt_bytes(tot.get(c, 0))}" for c in reversed(cats) if tot.get(c)]
        parts.append(f'<rect x="{_LEFT + i * dx:.2f}" y="{_TOP}" width="{dx:.2f}" height="{_CHART_H}" fill="transparent">'
                     f'<title>{html.escape(chr(10).join(lines))}</title></rect>')
    for band, (key, colors, name) in enumerate(((3, _STAGE_COLORS, "stage"), (4, _BAND_COLORS, "module"))):
        y0 = bottom + 6 + band * (_BAND_H + 4)
        parts.append(_text(_LEFT - 6, y0 + 15, name, 10, anchor="end", fill="#555"))
        palette: dict = {}
        for start, end, value in _runs([col[key] for col in cols]):
            color = palette.setdefault(value, colors[len(palette) % len(colors)])
            x0, w = _LEFT + start * dx, (end - start) * dx
            parts.append(f'<rect x="{x0:.2f}" y="{y0}" width="{w:.2f}" height="{_BAND_H}" fill="{color}" stroke="white" '
                         f'stroke-width="0.5"><title>{html.escape(str(value))}</title></rect>')
            if w > 7 * len(str(value)):
                parts.append(_text(x0 + w / 2, y0 + 15, value, 10, anchor="middle"))
    lx = _LEFT + width + 16
    parts.append(_text(lx, _TOP + 4, "at the peak", 11, weight="bold"))
    for k, cat in enumerate(reversed(cats)):  # legend, in stacking order from the top
        ly = _TOP + 22 + 19 * k
        parts.append(f'<rect x="{lx}" y="{ly - 10}" width="12" height="12" fill="{_COLORS.get(cat, "#999")}"/>')
        parts.append(_text(lx + 18, ly, f"{LABELS[cat]}  {fmt_bytes(peak[2].get(cat, 0))}", 11))
    parts.append(_text(_LEFT, bottom + 2 * _BAND_H + 40, f"{len(totals):,} memory events on {device}, "
                       f"{len(cols)} columns; each column shows the highest moment of its events", 10, fill="#777"))
    parts.append("</svg>")
    return "\n".join(parts)


def timeline_html(timeline, device, *, title: str = "", subtitle: str = "", row_of=None, report: str = "") -> str:
    """:func:`timeline_svg` in a self-contained HTML page, with ``report`` (text) below it.

    Example::

        >>> from deferinit.planning import Timeline, measure_step
        >>> timeline, model = Timeline(), torch.nn.Linear(64, 64)
        >>> _ = measure_step(model, (torch.randn(8, 64),), {}, torch.optim.SGD(model.parameters()), timeline=timeline)
        >>> page = timeline_html(timeline, torch.device("cpu"), title="Linear", report="peak 49.0 KiB")
        >>> page.startswith("<!DOCTYPE html>"), "<svg" in page, "<pre>peak 49.0 KiB</pre>" in page
        (True, True, True)
    """
    svg = timeline_svg(timeline, device, title=title, subtitle=subtitle, row_of=row_of)
    text = f"<pre>{html.escape(report)}</pre>" if report else ""
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title or "memory")}</title>'
            '<style>body{font-family:Helvetica,Arial,sans-serif;margin:16px}pre{font-size:12px}</style></head>'
            f"<body>\n{svg}\n{text}\n</body></html>\n")
