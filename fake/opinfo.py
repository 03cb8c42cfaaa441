"""What the schema of an ATen overload says, computed once per overload.

Which arguments it writes (``Tensor(a!)``, and the few writes kernels make
that their schema hides: :data:`HIDDEN_WRITES`), which one its outputs are views
of, whether it draws random numbers, whether it takes ``dtype=``, and
whether its meta kernel can be skipped: in-place fills keep the geometry of
their input, and their meta kernels are Python decompositions that cost up
to hundreds of microseconds (``normal_``), more than everything else an
operator costs here.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


# In-place random fills: they keep their input's geometry, and their meta
# kernels are Python decompositions (normal_'s costs ~0.5 ms and imports
# torch._dynamo on first use).  What the kernels would check is checked by
# eager's own kernels on stand-ins (deferinit.fake.checks).
_SKIP_META = frozenset({
    aten.uniform_.default,
    aten.normal_.default,
    aten.bernoulli_.float,
    aten.exponential_.default,
    aten.log_normal_.default,
    aten.cauchy_.default,
    aten.geometric_.default,
})


def _training(args, kwargs, position=5):
    training = args[position] if len(args) > position else kwargs.get("training")
    return bool(training)


def _always(args, kwargs):
    return True


# Writes the schema does not annotate: kernels that update tensors they take
# as plain ``Tensor?`` (batch norm's running statistics in training mode),
# as {overload name: (argument names, condition on (args, kwargs))}.
# Found by tools/scan_hidden_writes.py, which runs PyTorch's operator and
# module test inputs on CPU and compares every argument's bytes before and
# after each ATen call, and by reading the schemas of every overload that
# takes running statistics (the cuDNN/MIOpen kernels and SyncBatchNorm's
# gather_stats only exist on GPUs; their kernels update the running
# statistics they are given, as their CPU counterpart does).
_HIDDEN = {
    "native_batch_norm.default": (("running_mean", "running_var"), _training),
    "native_batch_norm.out": (("running_mean", "running_var"), _training),
    "batch_norm_update_stats.default": (("running_mean", "running_var"), _always),
    "batch_norm_update_stats.out": (("running_mean", "running_var"), _always),
    "cudnn_batch_norm.default": (("running_mean", "running_var"), _training),
    "cudnn_batch_norm.out": (("running_mean", "running_var"), _training),
    "miopen_batch_norm.default": (("running_mean", "running_var"), _training),
    "miopen_batch_norm.out": (("running_mean", "running_var"), _training),
    "batch_norm_gather_stats.default": (("running_mean", "running_var"), _always),
    "batch_norm_gather_stats.out": (("running_mean", "running_var"), _always),
    "batch_norm_gather_stats_with_counts.default": (("running_mean", "running_var"), _always),
    "batch_norm_gather_stats_with_counts.out": (("running_mean", "running_var"), _always),
}


def _hidden_writes() -> dict:
    """{OpOverload: (argument positions, condition)} for the overloads this build has."""
    out = {}
    for name, (args, condition) in _HIDDEN.items():
        packet_name, _, overload = name.partition(".")
        packet = getattr(aten, packet_name, None)
        func = getattr(packet, overload, None) if packet is not None else None
        if func is None:
            continue
        names = [a.name for a in func._schema.arguments]
        out[func] = (tuple(names.index(a) for a in args), condition)
    return out


HIDDEN_WRITES = _hidden_writes()


def _reads_data(func) -> str | None:
    """How to name ``func`` when it returns a number read from tensor data
    (PyTorch tags such operators ``data_dependent_output``: ``allclose``)."""
    if torch.Tag.data_dependent_output not in func.tags:
        return None
    if any("Tensor" in str(r.type) for r in func._schema.returns):
        return None
    return f"torch.{func._opname}()"


class OpInfo:
    __slots__ = ("func", "opname", "writes", "hidden", "view_arg", "random", "dtype_kwarg", "skip_meta", "reads_data")

    def __init__(self, func):
        schema = func._schema
        self.func = func
        self.opname = func._opname
        self.writes = tuple(
            i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write
        )
        # Positions the kernel writes although the schema does not say so,
        # and when it does: see HIDDEN_WRITES.
        self.hidden = HIDDEN_WRITES.get(func)
        if self.hidden is not None:
            self.writes = tuple(sorted(set(self.writes) | set(self.hidden[0])))
        self.view_arg = None
        if func.is_view:
            for i, a in enumerate(schema.arguments):
                if a.alias_info is not None and not a.alias_info.is_write:
                    self.view_arg = i
                    break
        self.random = torch.Tag.nondeterministic_seeded in func.tags
        self.dtype_kwarg = any(a.name == "dtype" for a in schema.arguments)
        self.skip_meta = func in _SKIP_META
        self.reads_data = _reads_data(func)

    def arg(self, args, kwargs, index):
        a = self.func._schema.arguments[index]
        if index < len(args) and not a.kwarg_only:
            return args[index]
        return kwargs.get(a.name)

    def written(self, args, kwargs) -> list:
        """The tensors the op writes in place, including writes its schema hides."""
        out = []
        positions = self.writes
        if self.hidden is not None and not self.hidden[1](args, kwargs):
            hidden = self.hidden[0]
            positions = tuple(p for p in positions if p not in hidden)
        for pos in positions:
            value = self.arg(args, kwargs, pos)
            if isinstance(value, torch.Tensor):
                out.append(value)
            elif isinstance(value, (list, tuple)):
                out.extend(v for v in value if isinstance(v, torch.Tensor))
        return out


_cache: dict = {}


def bind(func, args, kwargs) -> dict:
    """An operator call's arguments by schema name: given positionally or by
    keyword, else the schema's default (arguments without one and not given
    are absent).

    Example::

        >>> bind(torch.ops.aten.normal_.default, (torch.empty(2),), {"std": 2.0})["mean"]
        0.0
    """
    bound = {}
    for i, a in enumerate(func._schema.arguments):
        if i < len(args) and not a.kwarg_only:
            bound[a.name] = args[i]
        elif a.name in kwargs:
            bound[a.name] = kwargs[a.name]
        elif a.has_default_value():
            bound[a.name] = a.default_value
    return bound


def op_info(func) -> OpInfo:
    info = _cache.get(func)
    if info is None:
        info = _cache[func] = OpInfo(func)
    return info
