"""The table ``deferinit inspect`` prints: counts and bytes by dtype, computed
from shapes alone, and what training would need."""

from __future__ import annotations

import dataclasses

import torch

from ..session import is_deferred
from ..text import dtype_name, fmt_bytes, fmt_count, fmt_seconds

#: Bytes per trainable parameter with fp32 master weights (bf16 mixed precision,
#: as FSDP2's MixedPrecisionPolicy or autocast over fp32 weights train): the
#: fp32 weights, gradients and Adam's two moment estimates, 4 bytes each.
MASTER_BYTES_PER_PARAM = 16

#: Tensors per trainable parameter that Adam(W) holds: the weight, its gradient,
#: exp_avg and exp_avg_sq, all in the parameter's dtype (``zeros_like(p)``).
ADAM_TENSORS_PER_PARAM = 4


@dataclasses.dataclass
class Summary:
    """What ``deferinit inspect`` reports about a module, computed from shapes only.

    ``params``/``buffers`` map a dtype to ``[tensors, elements, bytes]``;
    ``largest`` is ``(name, class, elements, bytes)`` of the module with the
    most bytes of its own parameters.
    """

    params: dict
    buffers: dict
    largest: tuple | None
    devices: list
    deferred: int
    total: int
    trainable: dict = dataclasses.field(default_factory=dict)

    @property
    def param_count(self) -> int:
        return sum(v[1] for v in self.params.values())

    @property
    def param_bytes(self) -> int:
        return sum(v[2] for v in self.params.values())

    @property
    def buffer_bytes(self) -> int:
        return sum(v[2] for v in self.buffers.values())

    @property
    def frozen_bytes(self) -> int:
        """Bytes of the parameters that do not require grad: no gradient, no optimizer state."""
        return self.param_bytes - sum(v[2] for v in self.trainable.values())

    @property
    def adam_bytes(self) -> int:
        """Memory to train with Adam(W) as PyTorch's optimizers do by default, and
        ``deferinit plan`` by default: each trainable parameter, its gradient and
        its two moment estimates in the parameter's own dtype; plus frozen
        parameters and buffers."""
        trainable = sum(v[2] for v in self.trainable.values())
        return ADAM_TENSORS_PER_PARAM * trainable + self.frozen_bytes + self.buffer_bytes

    @property
    def master_bytes(self) -> int | None:
        """Memory to train with Adam(W) keeping fp32 master weights (mixed
        precision): 16 bytes per trainable parameter; None when every trainable
        parameter is already fp32 or wider, where it equals :attr:`adam_bytes`."""
        if all(not d.is_floating_point or d.itemsize >= 4 for d in self.trainable):
            return None
        count = sum(v[1] for v in self.trainable.values())
        return MASTER_BYTES_PER_PARAM * count + self.frozen_bytes + self.buffer_bytes


def summarize(module: torch.nn.Module) -> Summary:
    """Counts and bytes of a module's parameters and buffers (ties counted once), by dtype.

    Example::

        >>> s = summarize(deferred_init(torch.nn.Linear, 4096, 4096))
        >>> s.param_count, s.param_bytes
        (16781312, 67125248)
    """
    def table(tensors):
        out: dict = {}
        for t in tensors:
            row = out.setdefault(t.dtype, [0, 0, 0])
            row[0] += 1
            row[1] += t.numel()
            row[2] += t.numel() * t.element_size()
        return out

    params = list(module.parameters())
    buffers = list(module.buffers())
    largest = None
    for name, sub in module.named_modules():
        own = list(sub.parameters(recurse=False))
        nbytes = sum(p.numel() * p.element_size() for p in own)
        if own and (largest is None or nbytes > largest[3]):
            largest = (name or "<root>", type(sub).__name__, sum(p.numel() for p in own), nbytes)
    everything = params + buffers
    devices = sorted({str(t.device) for t in everything})
    return Summary(
        params=table(params),
        buffers=table(buffers),
        largest=largest,
        devices=devices,
        deferred=sum(1 for t in everything if is_deferred(t)),
        total=len(everything),
        trainable=table([p for p in params if p.requires_grad]),
    )


def format_report(
    s: Summary, seconds: float | None, *, title: str, shard: int | None = None, grown: int | None = None,
    dtype: str | None = None,
) -> str:
    """The table ``deferinit inspect`` prints; ``dtype`` says which default dtype
    the model was built under, and why.

    Example::

        >>> m = deferred_init(torch.nn.Transformer, d_model=1024, nhead=16)
        >>> print(format_report(summarize(m), 0.02, title="torch.nn:Transformer", shard=8))
    """
    lines = []
    head = f"{title}"
    if seconds is not None:
        head += f": built deferred in {fmt_seconds(seconds)}"
        if grown is not None:
            head += f", resident memory +{fmt_bytes(max(grown, 0))}"
    lines.append(head)
    lines.append("")
    rows = [("", "tensors", "elements", "bytes")]

    def section(label, table):
        tensors = sum(v[0] for v in table.values())
        numel = sum(v[1] for v in table.values())
        nbytes = sum(v[2] for v in table.values())
        rows.append((label, f"{tensors:,}", f"{numel:,}", fmt_bytes(nbytes)))
        if len(table) > 1 or (table and label == "parameters"):
            for dtype, (t, n, b) in sorted(table.items(), key=lambda kv: -kv[1][2]):
                rows.append((f"  {dtype_name(dtype)}", f"{t:,}", f"{n:,}", fmt_bytes(b)))
        return tensors, numel, nbytes

    pt, pn, pb = section("parameters", s.params)
    bt, bn, bb = section("buffers", s.buffers)
    rows.append(("total", f"{pt + bt:,}", f"{pn + bn:,}", fmt_bytes(pb + bb)))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        lines.append(
            f"  {r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]:>{widths[3]}}"
        )
    lines.append("")
    facts = []
    if s.largest is not None:
        name, cls, numel, nbytes = s.largest
        facts.append(("largest layer", f"{name} ({cls}): {numel:,} parameters, {fmt_bytes(nbytes)}"))
    facts.append(("parameters", fmt_count(s.param_count)))
    if dtype is not None:
        facts.append(("built with dtype", dtype))
    facts.append(("devices", ", ".join(s.devices) or "-"))
    facts.append(("deferred tensors", f"{s.deferred} of {s.total}"))
    facts.append(("train with Adam", _adam_text(s)))
    master = s.master_bytes
    if master is not None:
        facts.append(("with fp32 masters", _master_text(s)))
    if shard:
        per_weights = (s.param_bytes + s.buffer_bytes) / shard
        gather = f"; gathering the largest layer takes {fmt_bytes(s.largest[3])} more" if s.largest else ""
        masters = f" ({fmt_bytes(master / shard)} with fp32 masters)" if master is not None else ""
        facts.append((
            f"sharded over {shard}",
            f"{fmt_bytes(s.adam_bytes / shard)} per device to train with Adam{masters}, "
            f"{fmt_bytes(per_weights)} per device for the weights (fully sharded, as FSDP/ZeRO-3){gather}",
        ))
    if seconds is not None:
        facts.append(("deferral took", fmt_seconds(seconds)))
    width = max(len(k) for k, _ in facts)
    for k, v in facts:
        lines.append(f"  {k:<{width}}  {v}")
    return "\n".join(lines)


def _rest(s: Summary, last: str = "; activations not included") -> str:
    frozen = f" + {fmt_bytes(s.frozen_bytes)} frozen parameters" if s.frozen_bytes else ""
    return f"{frozen} + {fmt_bytes(s.buffer_bytes)} buffers{last}"


def _adam_text(s: Summary) -> str:
    """What "train with Adam" assumes: PyTorch's Adam(W) keeps its states in each
    parameter's dtype, and ``deferinit plan`` steps the model that way by default."""
    count = sum(v[1] for v in s.trainable.values())
    nbytes = sum(v[2] for v in s.trainable.values())
    how = "as `deferinit plan` steps by default"
    if not count:
        return f"{fmt_bytes(s.adam_bytes)}: no parameter requires grad{_rest(s)}"
    if len(s.trainable) == 1:
        (dtype,) = s.trainable
        size = f"{ADAM_TENSORS_PER_PARAM * dtype.itemsize} B x {count:,} parameters"
        what = f"{dtype_name(dtype)} weights, gradients, exp_avg, exp_avg_sq: states in the parameters' dtype, {how}"
    else:
        size = f"{ADAM_TENSORS_PER_PARAM} x {fmt_bytes(nbytes)} of trainable parameters"
        what = f"weights, gradients, exp_avg, exp_avg_sq, each in its parameter's dtype, {how}"
    return f"{fmt_bytes(s.adam_bytes)} = {size} ({what}){_rest(s)}"


def _master_text(s: Summary) -> str:
    count = sum(v[1] for v in s.trainable.values())
    return (
        f"{fmt_bytes(s.master_bytes)} = {MASTER_BYTES_PER_PARAM} B x {count:,} parameters (fp32 master weights, "
        f"gradients, exp_avg, exp_avg_sq: mixed precision, e.g. FSDP2's MixedPrecisionPolicy){_rest(s, '')}"
    )
