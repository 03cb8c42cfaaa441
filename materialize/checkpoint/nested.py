"""Nested dicts of tensors flattened to dotted keys, with bounded work.

``torch.save`` files often hold ``{"model": state_dict, ...}``; their tensors
are named by the path of keys, joined with dots (``"model.w"``).  An
unpickled object is untrusted: dicts may refer to each other (a cycle, or
one dict reached under many keys, which flattened naively makes
exponentially many keys from a few hundred bytes), nest deeply, or name
the same dotted key twice (``{"a.b": x, "a": {"b": y}}``: which one would
load is a guess), or name a tensor by a key that is neither a string nor
an integer.  All of these are refused; the walk is iterative, and
the characters of the keys it builds are bounded.
"""

from __future__ import annotations

import torch

from .errors import CheckpointError


MAX_DEPTH = 100
# Characters of all the dotted keys built, together.
MAX_KEY_CHARS = 1 << 28


def flatten_tensors(obj, error=CheckpointError, what: str = "the state dict") -> list:
    """``[(dotted key, tensor)]`` for every tensor in nested dicts (other values
    skipped); ``error``: the class raised for a structure refused.

    Example::

        >>> t = torch.ones(1)
        >>> flatten_tensors({"model": {"w": t, "step": 3}, "b": t})
        [('model.w', tensor([1.])), ('b', tensor([1.]))]
        >>> inner = {"w": t}
        >>> flatten_tensors({"a": inner, "b": inner})
        Traceback (most recent call last):
        ...
        deferinit.materialize.checkpoint.errors.CheckpointError: the state dict holds one dict under both 'a' and 'b' ...
    """
    if isinstance(obj, torch.Tensor):
        return [("", obj)]
    if not isinstance(obj, dict):
        return []
    out: list = []
    seen: dict = {id(obj): ""}
    keys: dict = {}
    chars = 0
    stack = [(iter(obj.items()), "", 1)]
    while stack:
        items, prefix, depth = stack[-1]
        for k, v in items:
            is_dict = isinstance(v, dict)
            if not is_dict and not isinstance(v, torch.Tensor):
                continue
            if not isinstance(k, (str, int)):
                # str() of a pickled tuple or list may take exponential time.
                raise error(f"{what} names a tensor or dict by a {type(k).__name__}, not a string or an integer")
            key = f"{prefix}.{k}" if prefix else str(k)
            chars += len(key)
            if chars > MAX_KEY_CHARS:
                raise error(f"{what} has keys of more than {MAX_KEY_CHARS} characters in all (nested dicts, joined with dots)")
            if not is_dict:
                if key in keys:
                    raise error(f"{what} names {key[:200]!r} twice (nested dicts, joined with dots, give a key it also has)")
                keys[key] = len(out)
                out.append((key, v))
                continue
            if id(v) in seen:
                raise error(
                    f"{what} holds one dict under both {seen[id(v)][:100]!r} and {key[:100]!r} (or a dict "
                    "inside itself); load_checkpoint names every tensor by one path of keys"
                )
            if depth >= MAX_DEPTH:
                raise error(f"{what} nests dicts more than {MAX_DEPTH} deep")
            seen[id(v)] = key
            stack.append((iter(v.items()), key, depth + 1))
            break
        else:
            stack.pop()
    return out
