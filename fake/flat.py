"""Flattening ATen call arguments, fast.

The dispatcher hands Python ``args`` (leaves, or flat lists of leaves such as
sizes and tensor lists) and ``kwargs`` (keyword-only arguments, same shapes).
``torch.utils._pytree`` handles any nesting but costs more than the meta
kernel itself on this hot path; this module handles the one level ATen
schemas use and falls back to pytree for anything deeper.
"""

from __future__ import annotations

from torch.utils._pytree import tree_flatten, tree_unflatten

_SEQ = (list, tuple)


class Spec:
    """How to rebuild ``(args, kwargs)`` from a flat list.  One object per shape of
    call (:func:`flatten` hands out the same one again): a record of many
    alike calls holds it once, and its rebuild is worked out once."""

    __slots__ = ("arg_shapes", "kw_keys", "kw_shapes", "plain", "rebuild")

    def __init__(self, arg_shapes, kw_keys, kw_shapes):
        self.arg_shapes = arg_shapes
        self.kw_keys = kw_keys
        self.kw_shapes = kw_shapes
        # No list or tuple among the arguments: the number of positional ones.
        flat = all(s is None for s in arg_shapes) and all(s is None for s in kw_shapes)
        self.plain = len(arg_shapes) if flat else None
        self.rebuild = _rebuild_of(self)


def _rebuild_of(spec):
    """A function ``flat -> (args, kwargs)`` written out for ``spec`` (as
    ``torch.fx`` writes its code): a replay rebuilds the arguments of every
    node, and a loop over the shapes costs more than the call of a small
    factory.  None for long calls (tensor lists), rebuilt by the loop."""
    i = 0

    def part(shape):
        nonlocal i
        if shape is None:
            i += 1
            return f"f[{i - 1}]"
        t, n = shape
        items = ", ".join(f"f[{j}]" for j in range(i, i + n))
        i += n
        return f"[{items}]" if t is list else f"({items}{',' if n == 1 else ''})"

    args = [part(shape) for shape in spec.arg_shapes]
    kwargs = [f"{key!r}: {part(shape)}" for key, shape in zip(spec.kw_keys, spec.kw_shapes)]
    if i > 64 or not all(type(k) is str for k in spec.kw_keys):
        return None
    code = f"def rebuild(f):\n    return ({''.join(a + ', ' for a in args)}), {{{', '.join(kwargs)}}}\n"
    scope: dict = {}
    exec(code, scope)  # noqa: S102 - code built above from ints and the kwargs' names only
    return scope["rebuild"]


_SPECS: dict = {}
_KEPT = 4096


def flatten(args, kwargs):
    """``(flat, spec)`` for ATen-style ``args``/``kwargs``."""
    flat: list = []
    arg_shapes = _flatten_into(args, flat)
    keys = tuple(kwargs) if kwargs else ()
    kw_shapes = _flatten_into(kwargs.values(), flat) if kwargs else ()
    if arg_shapes is None or kw_shapes is None:
        return tree_flatten((args, kwargs))
    shape = (arg_shapes, keys, kw_shapes)
    spec = _SPECS.get(shape)
    if spec is None:
        spec = Spec(arg_shapes, keys, kw_shapes)
        if len(_SPECS) < _KEPT:  # a bound: tensor lists of every length are shapes too
            spec = _SPECS.setdefault(shape, spec)
    return flat, spec


def _flatten_into(values, flat: list):
    """Append ``values`` (leaves, or flat lists/tuples of leaves) to ``flat``;
    return their shapes, or None if one is nested deeper."""
    shapes = []
    for v in values:
        t = type(v)
        if t is list or t is tuple:
            for b in v:
                if type(b) in _SEQ:
                    return None
            shapes.append((t, len(v)))
            flat.extend(v)
        else:
            shapes.append(None)
            flat.append(v)
    return tuple(shapes)


def unflatten(flat, spec):
    """Rebuild ``(args, kwargs)``."""
    if type(spec) is not Spec:
        return tree_unflatten(flat, spec)
    if spec.rebuild is not None:
        return spec.rebuild(flat)
    n = spec.plain
    if n is not None:
        return tuple(flat[:n]), dict(zip(spec.kw_keys, flat[n:]))
    i = 0
    args = []
    for shape in spec.arg_shapes:
        if shape is None:
            args.append(flat[i])
            i += 1
        else:
            t, n = shape
            args.append(t(flat[i : i + n]))
            i += n
    kwargs = {}
    for key, shape in zip(spec.kw_keys, spec.kw_shapes):
        if shape is None:
            kwargs[key] = flat[i]
            i += 1
        else:
            t, n = shape
            kwargs[key] = t(flat[i : i + n])
            i += n
    return tuple(args), kwargs


def flatten_output(out):
    """``(flat, rebuild)`` of an operator's result: a tensor, a tuple/list of them, or other."""
    t = type(out)
    if t is tuple or t is list:
        for b in out:
            if type(b) in _SEQ:
                flat, spec = tree_flatten(out)
                return flat, spec
        return list(out), t
    return [out], None


def unflatten_output(flat, how):
    if how is None:
        return flat[0]
    if how is tuple or how is list:
        return how(flat)
    return tree_unflatten(flat, how)
