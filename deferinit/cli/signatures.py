"""What a target callable takes, seen through the wrappers libraries put around it."""

from __future__ import annotations

import inspect


def signatures(fn) -> list:
    """The signatures worth checking arguments against: the one of the function
    ``fn`` wraps (``functools.wraps``), then ``fn``'s own, leaving out opaque
    ones (``(*args, **kwargs)``, ``(**kwargs)``) that say nothing of what it takes.

    A wrapper may point ``__wrapped__`` at a bound method, whose signature has
    lost its first parameter once already (transformers' Auto classes'
    ``from_config`` then reads as ``(**kwargs)``); ``fn``'s own signature,
    ``(config, **kwargs)``, is the true one there.

    Example::

        >>> [str(s) for s in signatures(transformers.AutoModelForCausalLM.from_config)]
        ['(config, **kwargs)']
    """
    found = []
    for follow in (True, False):
        try:
            sig = inspect.signature(fn, follow_wrapped=follow)
        except (TypeError, ValueError):
            continue
        params = sig.parameters.values()
        opaque = params and all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)
        if not opaque and sig not in found:  # a callable taking nothing is still worth checking
            found.append(sig)
    return found


def first_parameter(fn) -> str | None:
    """The name of the first positional parameter ``fn`` takes, by its first
    :func:`signatures`; None when it takes none or says nothing (opaque).

    Example::

        >>> first_parameter(torch.nn.Linear), first_parameter(lambda *args, **kwargs: None)
        ('in_features', None)
    """
    for sig in signatures(fn)[:1]:
        for p in sig.parameters.values():
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                return p.name
    return None
