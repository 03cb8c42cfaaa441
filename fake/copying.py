"""``copy.deepcopy`` of tensors while fakes are about: what eager does, on fakes.

Eager ``Tensor.__deepcopy__`` copies the whole storage once per ``memo``
(so views copied together still share memory, at their offsets), while
``Parameter.__deepcopy__`` clones just the tensor.  ``nn.TransformerEncoder``
deep-copies its layer, and a constructor may deep-copy a template module:
both must come out as fakes with the same layout and aliasing as eager
copies.  The copies are made of ordinary operators (``as_strided``,
``clone``), so a deferred copy records how it was made.
"""

from __future__ import annotations

import copy as _copy

import torch


def _storage_key(t: torch.Tensor):
    source = t.__dict__.get("_shadow", t)  # a fake's memory is its shadow's
    return ("deferinit-storage-copy", source.untyped_storage()._cdata)


def deepcopy_tensor(t: torch.Tensor, memo: dict, internal=frozenset()) -> torch.Tensor:
    """Deep-copy ``t`` (a fake, or a real tensor under a fake mode) into a fake.

    Example::

        >>> with fake_mode():
        ...     base = torch.zeros(4)
        >>> a, b = copy.deepcopy([base, base[1:]])
        >>> b.storage_offset(), is_fake(a)
        (1, True)
    """
    if id(t) in memo:
        return memo[id(t)]
    d = t.__dict__
    with torch.no_grad():
        if d.get("_is_param") or isinstance(t, torch.nn.Parameter):
            # Parameter.__deepcopy__: a clone of the tensor alone.
            result = t.detach().clone(memory_format=torch.preserve_format)
        else:
            result = _copy_through_storage(t, memo)
    if t.requires_grad and (result.is_floating_point() or result.is_complex()):
        result.requires_grad_(True)
    for key, value in d.items():
        if key in internal and key not in ("_is_param", "_param_cls"):
            continue
        result.__dict__[key] = value if key in internal else _copy.deepcopy(value, memo)
    memo[id(t)] = result
    return result


def _copy_through_storage(t: torch.Tensor, memo: dict) -> torch.Tensor:
    key = _storage_key(t)
    nbytes = t.__dict__.get("_shadow", t).untyped_storage().nbytes()
    itemsize = t.element_size()
    whole = memo.get(key)
    if whole is None or whole.dtype != t.dtype:
        if nbytes % itemsize:
            return t.clone(memory_format=torch.preserve_format)
        whole = torch.as_strided(t.detach(), (nbytes // itemsize,), (1,), 0).clone()
        memo[key] = whole
        memo.setdefault(id(memo), []).append(whole)  # the memo's keep-alive list
    # A tensor set_ on the copied storage, as eagerly: no view of the copy
    # (a view would take its requires_grad from the copy's, under no_grad).
    result = whole.new_empty(0)
    result.set_(whole, t.storage_offset(), t.size(), t.stride())
    return result
