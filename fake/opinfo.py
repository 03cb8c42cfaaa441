"""What the schema of an ATen overload says, computed once per overload.

Which arguments it writes (``Tensor(a!)``), which one its outputs are views
of, whether it draws random numbers, whether it takes ``dtype=``, and
whether its meta kernel can be skipped: in-place fills keep the geometry of
their input, and their meta kernels are Python decompositions that cost up
to hundreds of microseconds (``normal_``), more than everything else an
operator costs here.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def _check_uniform(args, kwargs):
    low = args[1] if len(args) > 1 else kwargs.get("from", 0.0)
    high = args[2] if len(args) > 2 else kwargs.get("to", 1.0)
    if low > high:
        raise RuntimeError(f"uniform_ expects to return a [from, to) range, but found from={low} > to={high}")


def _check_normal(args, kwargs):
    std = args[2] if len(args) > 2 else kwargs.get("std", 1.0)
    if std < 0:
        raise RuntimeError(f"normal expects std >= 0.0, but found std {std}")


# In-place ops that keep their input's geometry and whose only checks on
# scalar arguments are replicated here; the checks on the tensor itself
# (its dtype) are made by the meta kernel the first time a dtype is seen.
_SKIP_META = {
    aten.uniform_.default: _check_uniform,
    aten.normal_.default: _check_normal,
    aten.fill_.Scalar: None,
    aten.zero_.default: None,
    aten.bernoulli_.float: None,
    aten.exponential_.default: None,
    aten.log_normal_.default: None,
    aten.cauchy_.default: None,
    aten.geometric_.default: None,
}


class OpInfo:
    __slots__ = ("func", "opname", "writes", "view_arg", "random", "dtype_kwarg", "skip_meta", "checked_dtypes")

    def __init__(self, func):
        schema = func._schema
        self.func = func
        self.opname = func._opname
        self.writes = tuple(
            i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write
        )
        self.view_arg = None
        if func.is_view:
            for i, a in enumerate(schema.arguments):
                if a.alias_info is not None and not a.alias_info.is_write:
                    self.view_arg = i
                    break
        self.random = torch.Tag.nondeterministic_seeded in func.tags
        self.dtype_kwarg = any(a.name == "dtype" for a in schema.arguments)
        self.skip_meta = func in _SKIP_META
        self.checked_dtypes: set = set()

    def arg(self, args, kwargs, index):
        a = self.func._schema.arguments[index]
        if index < len(args) and not a.kwarg_only:
            return args[index]
        return kwargs.get(a.name)

    def written(self, args, kwargs) -> list:
        """The tensors the op writes in place."""
        out = []
        for pos in self.writes:
            value = self.arg(args, kwargs, pos)
            if isinstance(value, torch.Tensor):
                out.append(value)
            elif isinstance(value, (list, tuple)):
                out.extend(v for v in value if isinstance(v, torch.Tensor))
        return out

    def check_scalars(self, args, kwargs) -> None:
        check = _SKIP_META.get(self.func)
        if check is not None:
            check(args, kwargs)


_cache: dict = {}


def op_info(func) -> OpInfo:
    info = _cache.get(func)
    if info is None:
        info = _cache[func] = OpInfo(func)
    return info
