"""Output geometry of operators without a meta kernel, from real stand-ins.

Some operators have no meta kernel although the geometry of their outputs
follows from the geometry of their inputs alone (``geqrf``, which
``torch.nn.utils.parametrizations.orthogonal`` calls; ``histogram``).  For
those, the CPU kernel runs on *stand-ins*: real CPU tensors with the inputs'
sizes, strides, offsets and dtypes, filled with values from a private
generator (the user's generators are never touched), and the outputs'
geometry is read off the result.  Operators that PyTorch tags as having a
data-dependent output shape (``nonzero``, ``unique``, ``masked_select``)
or data-dependent output (``allclose``), and random ones, never take this
path: no stand-in can tell their geometry, and a stand-in draw would move a
generator.

The stand-ins cost real memory and time, so their total size is bounded:
``DEFERINIT_STANDIN_LIMIT_BYTES`` (default 64 MiB); past it the operator is
unsupported as before.  The geometry is the CPU kernel's.
"""

from __future__ import annotations

import os

import torch

from .bypass import no_python_dispatch
from .errors import UnsupportedOperatorError
from .extent import extent_of
from .flat import flatten, flatten_output, unflatten, unflatten_output

LIMIT_BYTES = int(os.environ.get("DEFERINIT_STANDIN_LIMIT_BYTES", str(64 << 20)))

_CPU = torch.device("cpu")
_META = torch.device("meta")


def data_dependent(func) -> bool:
    """Whether PyTorch says ``func``'s output shape or result is read from the data."""
    tags = func.tags
    return torch.Tag.dynamic_output_shape in tags or torch.Tag.data_dependent_output in tags


def refusal(func) -> str | None:
    """Why stand-ins cannot give ``func``'s output geometry, or None if they can."""
    if torch.Tag.nondeterministic_seeded in func.tags:
        return "it draws random numbers"
    if data_dependent(func):
        return "its output shape depends on the data"
    return None


def standin_bytes(margs, mkwargs) -> int:
    """Bytes the stand-ins of the meta tensors in ``margs``/``mkwargs`` would take."""
    flat, _ = flatten(margs, mkwargs)
    return sum(extent_of(x) * x.dtype.itemsize for x in flat if isinstance(x, torch.Tensor) and x.is_meta)


def _standin(meta: torch.Tensor, fill) -> torch.Tensor:
    n = extent_of(meta)
    if fill is not None and (meta.dtype.is_floating_point or meta.dtype.is_complex):
        storage = torch.rand(n, dtype=meta.dtype, generator=fill)
    else:
        storage = torch.zeros(n, dtype=meta.dtype)  # in range for any index argument
    return storage.as_strided(meta.size(), meta.stride(), meta.storage_offset())


def run_on_standins(func, margs, mkwargs):
    """``func``'s result on ``margs``/``mkwargs`` (meta tensors), computed by its
    CPU kernel on stand-ins: meta tensors of the geometry the CPU kernel gives.

    Outputs that are an input (in-place and ``out=`` ops) come back as that
    meta input, resized as the kernel resized it; views of an input come back
    as the same view of the meta input; other outputs are new meta tensors.
    Raises what the CPU kernel raises (its argument checks are eager's).  The
    kernel runs twice, on random and on zero stand-ins: if the two results
    differ in geometry, it depends on the data after all (``linalg.lstsq``'s
    residuals, untagged) and ``UnsupportedOperatorError`` is raised.
    """
    flat, spec = flatten(margs, mkwargs)
    with no_python_dispatch(), torch.no_grad():
        standins, result = _execute(func, flat, spec, torch.Generator().manual_seed(0))
        try:
            _, other = _execute(func, flat, spec, None)
        except NotImplementedError:
            raise
        except Exception:  # noqa: BLE001 - zeros may be invalid data (singular), not an answer
            other = result
        if _geometry(other) != _geometry(result):
            error = UnsupportedOperatorError(
                f"{func} cannot run on fake tensors: it has no meta kernel, and its output shape "
                "depends on the data (stand-ins of different values gave different shapes). Run "
                "it on real tensors instead (materialize them first)."
            )
            error.data_dependent = True
            raise error
        return _to_meta(result, standins)


def _execute(func, flat, spec, fill):
    """Run ``func`` with one stand-in per meta tensor of ``flat``: (stand-ins by meta, result)."""
    standins = {}
    reals = list(flat)
    for i, x in enumerate(flat):
        if isinstance(x, torch.Tensor) and x.is_meta:
            pair = standins.get(id(x))
            if pair is None:
                pair = standins[id(x)] = (_standin(x, fill), x)
            reals[i] = pair[0]
        elif type(x) is torch.device and x.type == "meta":
            reals[i] = _CPU
    rargs, rkwargs = unflatten(reals, spec)
    return list(standins.values()), func(*rargs, **rkwargs)


def _geometry(result) -> list:
    out, _ = flatten_output(result)
    return [(y.dtype, y.size(), y.stride(), y.storage_offset()) if isinstance(y, torch.Tensor) else y for y in out]


def _to_meta(result, standins):
    by_object = {id(real): meta for real, meta in standins}
    by_storage = {_address(real): meta for real, meta in standins if _address(real)}
    out_flat, how = flatten_output(result)
    for i, y in enumerate(out_flat):
        if not isinstance(y, torch.Tensor):
            continue
        meta = by_object.get(id(y))
        if meta is not None:  # an input written in place
            if meta.size() != y.size() or meta.stride() != y.stride():
                meta.resize_(extent_of(y)).as_strided_(y.size(), y.stride(), y.storage_offset())
            out_flat[i] = meta
            continue
        base = by_storage.get(_address(y))
        if base is not None:  # a view of an input
            out_flat[i] = base.as_strided(y.size(), y.stride(), y.storage_offset())
        else:
            out_flat[i] = torch.empty(extent_of(y), dtype=y.dtype, device=_META).as_strided(
                y.size(), y.stride(), y.storage_offset()
            )
    return out_flat[0] if how is None else unflatten_output(out_flat, how)


def _address(t: torch.Tensor) -> int:
    storage = t.untyped_storage()
    return storage.data_ptr() if storage.nbytes() else 0
