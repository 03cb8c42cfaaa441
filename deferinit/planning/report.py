"""The text ``deferinit plan`` prints: the peak per device by category, and a
row per top-level module (repeated blocks folded into one row)."""

from __future__ import annotations

import torch

from ..text import fmt_bytes, fmt_seconds
from .step import COLUMNS, LABELS, forward_flops, module_peak


def module_rows(model: torch.nn.Module) -> list[tuple[str, list[torch.nn.Module]]]:
    """``(label, modules)`` for the rows of the per-module table.

    The children of the model; a child that holds a ``ModuleList`` (a decoder,
    an encoder) is replaced by its own children; the blocks of a
    ``ModuleList`` of one class share a row (``layers.0-79 (80 x DecoderLayer)``).
    """
    rows: list = []

    def visit(prefix: str, module: torch.nn.Module) -> None:
        for name, child in module.named_children():
            path = prefix + name
            if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
                blocks = list(child.named_children())
                if blocks and len({type(b) for _, b in blocks}) == 1 and len(blocks) > 1:
                    label = f"{path}.{blocks[0][0]}-{blocks[-1][0]} ({len(blocks)} x {type(blocks[0][1]).__name__})"
                    rows.append((label, [b for _, b in blocks]))
                else:
                    rows.extend((f"{path}.{n}", [b]) for n, b in blocks)
            elif any(isinstance(g, (torch.nn.ModuleList, torch.nn.ModuleDict)) for g in child.children()):
                visit(path + ".", child)
            else:
                rows.append((path, [child]))

    visit("", model)
    return rows or [(type(model).__name__, [model])]


def _param_bytes(modules) -> int:
    seen, total = set(), 0
    for m in modules:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
    return total


def _table(rows, align) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [f"{c:<{w}}" if a == "<" else f"{c:>{w}}" for c, w, a in zip(r, widths, align)]
        out.append("  " + "  ".join(cells).rstrip())
    return out


def fmt_flops(n: int) -> str:
    """Floating-point operations with an SI prefix.

    Example::

        >>> fmt_flops(1708074133880832), fmt_flops(36175872), fmt_flops(0)
        ('1.71 PFLOP', '36.2 MFLOP', '-')
    """
    for unit, size in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}FLOP"
    return f"{n} FLOP" if n else "-"


def _low_precision_training(model, setup) -> str:
    """A note when the parameters (hence the optimizer state) are in a lower dtype than
    float32 and no mixed precision keeps float32 masters: not every recipe does that."""
    if any("mixed precision" in item for item in setup.get("recipe", ())):
        return ""
    low = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()
                  if p.is_floating_point() and p.element_size() < 4})
    if not low:
        return ""
    return (f"parameters, gradients and optimizer state in {'/'.join(low)}: no float32 master weights "
            f"(--mixed-precision bf16 with a float32 build plans those)")


def format_plan(model, measured, *, call: str, setup: dict, seconds: float, build_seconds: float) -> str:
    """The report of one planned step (see ``deferinit plan --help``)."""
    device = setup["device"]
    optimizer, _, args = setup["optimizer"].partition(" (")
    passes = "forward, backward" if setup.get("accumulate", 1) == 1 else f"{setup['accumulate']} x (forward, backward)"
    inputs = []
    if setup["batch"]:
        inputs.append(f"token ids {'x'.join(map(str, setup['batch']))}")
    inputs += ["x".join(map(str, shape)) + (f" {dtype}".replace("torch.", " ") if dtype else "") for shape, dtype in setup["inputs"]]
    where = f"fake {device}"
    if setup["shard"]:
        where += f", rank {setup['rank']} of {setup['shard']} (FSDP2, fake process group)"
    lines = [
        f"{call}: one training step ({passes}, {optimizer} step) on {where}",
        f"  inputs {', '.join(inputs)}; built deferred in {setup['dtype']} in {fmt_seconds(build_seconds)}, step planned in "
        f"{fmt_seconds(seconds)}; measured by PyTorch's {'FSDPMemTracker' if setup['shard'] else 'MemTracker'} and FlopCounterMode",
    ]
    recipe = ([f"optimizer arguments {args[:-1]}"] if args else []) + list(setup.get("recipe", ()))
    lines += [f"  {item}" for item in recipe]
    low = _low_precision_training(model, setup)
    if low:
        lines.append(f"  {low}")
    lines.append("")
    devices = sorted(set(measured.peak) | set(measured.after), key=lambda d: (d != device, str(d)))
    snaps = [(measured.peak.get(d, {}), measured.after.get(d, {})) for d in devices]
    names = [n for n in LABELS if any(p.get(n) or a.get(n) for p, a in snaps)]

    def cell(snap, name):
        return fmt_bytes(snap[name]) if snap.get(name) else "-"

    rows = [("memory", *[c for d in devices for c in (f"{d} peak", f"{d} after the step")])]
    rows += [(f"  {LABELS[n]}", *[cell(s, n) for pair in snaps for s in pair]) for n in names]
    rows.append(("  total", *[cell(s, "Total") for pair in snaps for s in pair]))
    lines += _table(rows, "<" + ">" * (2 * len(devices)))
    lines.append("")

    lines.append(f"per module: {device}'s memory at its highest while the module runs (forward or backward)")
    head = ("module", "its size", "peak in", *COLUMNS, "total", "forward FLOPs")
    table = [head]
    for label, modules in [("(whole model)", [model])] + module_rows(model):
        best = None
        for m in modules:
            peak = module_peak(measured, m, device)
            if peak is not None and (best is None or peak[1]["Total"] > best[1]["Total"]):
                best = peak
        flops = sum(forward_flops(measured, m) for m in modules)
        if best is None:
            cells = ["-"] * (len(COLUMNS) + 2)
        else:
            phase, cats = best
            cells = [phase] + [fmt_bytes(sum(cats.get(c, 0) for c in group)) for group in COLUMNS.values()]
            cells.append(fmt_bytes(cats["Total"]))
        table.append((label, fmt_bytes(_param_bytes(modules)), *cells, fmt_flops(flops)))
    lines += _table(table, "<>" + "<" + ">" * (len(COLUMNS) + 2))
    lines.append("")
    forward = forward_flops(measured)
    lines.append(
        f"FLOPs per step (FlopCounterMode): {fmt_flops(measured.flops)} ({measured.flops:,}): "
        f"forward {fmt_flops(forward)}, backward {fmt_flops(measured.flops - forward)}"
    )
    return "\n".join(lines)


def row_labels(model, measured):
    """``row_of(module name)``: the report's row (:func:`module_rows`) of a module the
    step's tracker named, for the picture's module band."""
    names = measured.tracker._mod_tracker._known_modules
    prefixes = {}
    for label, modules in module_rows(model):
        for m in modules:
            if m in names:
                prefixes[names[m]] = label
    root = names.get(model, type(model).__name__)

    def row_of(name: str) -> str:
        while name:
            if name in prefixes:
                return prefixes[name]
            if name == root:
                return "(whole model)"
            name = name.rpartition(".")[0]
        return "(outside any module)"

    return row_of
