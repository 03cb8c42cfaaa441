"""Meta kernels remembered by the geometry of their arguments.

A training step of an 80-layer model runs the same few dozen operators on
the same shapes 80 times, and many meta kernels are Python decompositions
costing tens to hundreds of microseconds.  What a meta kernel returns
depends only on its arguments' sizes, strides, offsets and dtypes, the
other arguments' values and the default dtype, so for operators that return
fresh tensors (no views, no in-place writes, no data-dependent shapes) the
result's layout is remembered and later calls get new meta tensors of that
layout without running the kernel.  PyTorch's FakeTensorMode caches its
dispatch the same way.

Example::

    >>> from deferinit.fake.flat import flatten
    >>> from deferinit.fake.opinfo import op_info
    >>> a = torch.empty(4, 8, device="meta")
    >>> info = op_info(torch.ops.aten.mm.default)
    >>> first = call(info, *flatten((a, a.t()), {}))
    >>> again = call(info, *flatten((a, a.t()), {}))
    >>> again.shape, again is first, again.untyped_storage().nbytes()
    (torch.Size([4, 4]), False, 64)
"""

from __future__ import annotations

import torch

from .bypass import no_python_dispatch
from .extent import extent
from .flat import Spec, flatten_output, unflatten, unflatten_output

#: Set to False to run every meta kernel (tests compare both).
ENABLED = True
_MAX_ENTRIES = 50_000
_SKIP_TAGS = frozenset({torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output, torch.Tag.inplace_view})
_HASHABLE = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)
_UNCACHEABLE = object()

_cache: dict = {}
_cacheable: dict = {}  # func -> bool


def _op_cacheable(info) -> bool:
    ok = _cacheable.get(info.func)
    if ok is None:
        func = info.func
        ok = _cacheable[func] = not (
            info.writes
            or func.is_view
            or any(r.alias_info is not None for r in func._schema.returns)
            or any(t in _SKIP_TAGS for t in func.tags)
        )
    return ok


def _key(func, metas, spec):
    if type(spec) is not Spec:
        return None
    parts = [func, spec.arg_shapes, spec.kw_keys, spec.kw_shapes, torch.get_default_dtype()]
    for x in metas:
        if isinstance(x, torch.Tensor):
            if type(x) is not torch.Tensor or not x.is_meta:
                return None
            parts.append((tuple(x.shape), x.stride(), x.storage_offset(), x.dtype))
        elif type(x) in _HASHABLE:
            parts.append((type(x), x))
        else:
            return None
    return tuple(parts)


def _layout(out, inputs):
    """What rebuilds ``out`` (a meta kernel's result), or _UNCACHEABLE."""
    flat, how = flatten_output(out)
    storages = set()
    described = []
    for y in flat:
        if isinstance(y, torch.Tensor):
            if type(y) is not torch.Tensor or not y.is_meta:
                return _UNCACHEABLE
            storage = y.untyped_storage()._cdata
            if storage in storages or storage in inputs:
                return _UNCACHEABLE  # outputs sharing memory, or an input's
            storages.add(storage)
            nbytes = y.untyped_storage().nbytes()
            plain = y.storage_offset() == 0 and nbytes == extent(y.shape, y.stride()) * y.element_size()
            described.append(("t", tuple(y.shape), y.stride(), y.storage_offset(), y.dtype, nbytes, plain))
        elif type(y) in _HASHABLE:
            described.append(("v", y))
        else:
            return _UNCACHEABLE
    return how, tuple(described)


def _rebuild(layout):
    how, described = layout
    flat = []
    for d in described:
        if d[0] == "v":
            flat.append(d[1])
            continue
        _, size, stride, offset, dtype, nbytes, plain = d
        if plain:  # the storage empty_strided would make: one call instead of three
            flat.append(torch.empty_strided(size, stride, dtype=dtype, device="meta"))
            continue
        storage = torch.UntypedStorage(nbytes, device="meta")
        flat.append(torch.empty(0, dtype=dtype, device="meta").set_(storage, offset, size, stride))
    return unflatten_output(flat, how)


def call(info, metas, spec, margs=None, mkwargs=None):
    """``info.func`` on meta arguments ``metas`` (flattened as ``spec``, or
    already unflattened as ``margs, mkwargs``), from the cache when it can."""
    func = info.func
    key = _key(func, metas, spec) if ENABLED and _op_cacheable(info) else None
    if margs is None:
        margs, mkwargs = unflatten(metas, spec)
    with no_python_dispatch():
        if key is not None:
            layout = _cache.get(key)
            if layout is not None and layout is not _UNCACHEABLE:
                return _rebuild(layout)
        result = func(*margs, **mkwargs)
        if key is not None and key not in _cache:
            inputs = {x.untyped_storage()._cdata for x in metas if isinstance(x, torch.Tensor)}
            if len(_cache) >= _MAX_ENTRIES:
                _cache.clear()
            _cache[key] = _layout(result, inputs)
    return result
