"""Which checkpoint key goes where, and what to say when the keys do not fit.

Checkpoint keys go through ``prefix`` (only keys starting with it count,
without it) and ``rename`` (a function from a checkpoint key to a module
key, or None to skip it) before ``load_state_dict``'s walk sees them
(:mod:`.capture`); the walk says which keys are missing and unexpected, as
``load_state_dict`` does, hooks included.  One difference, kept on purpose:
a tied tensor is *missing* only when the checkpoint has none of its names
(``safetensors.torch.save_model`` and transformers save a tied tensor once).

When the keys do not fit because of a common prefix (a ``LlamaForCausalLM``
checkpoint, keys ``model.…``, for a ``LlamaModel``; or the reverse), the
error says so and names the argument that fixes it.  Long lists of keys are
cut to their first few and a count.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import torch

from .errors import CheckpointError, CheckpointMismatchError


# Keys (or messages) shown in an error before "and N more".
SHOWN = 5


class LoadResult(NamedTuple):
    """What ``load_checkpoint`` returns, like ``load_state_dict``'s ``_IncompatibleKeys``:
    the module's keys the checkpoint lacks, and the checkpoint's keys the module lacks.

    Example::

        >>> m = deferred_init(torch.nn.Linear, 2, 3)
        >>> missing, unexpected = load_checkpoint(m, {"bias": torch.zeros(3), "scale": torch.ones(1)}, strict=False)
        >>> missing, unexpected
        (['weight'], ['scale'])
    """

    missing_keys: list
    unexpected_keys: list


def module_keys(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` in ``state_dict`` order (persistent buffers only, ties under each name).

    Example::

        >>> [k for k, _ in module_keys(torch.nn.BatchNorm1d(2))]
        ['weight', 'bias', 'running_mean', 'running_var', 'num_batches_tracked']
    """
    out = []
    for prefix, sub in module.named_modules(remove_duplicate=False):
        dot = prefix + "." if prefix else ""
        for name, t in sub._parameters.items():
            if t is not None:
                out.append((dot + name, t))
        for name, t in sub._buffers.items():
            if t is not None and name not in sub._non_persistent_buffers_set:
                out.append((dot + name, t))
    return out


def map_keys(entries: dict, *, prefix: str = "", rename=None) -> dict:
    """``module key -> entry``: the checkpoint's keys through ``prefix`` and ``rename``.

    Example::

        >>> sorted(map_keys({"model.w": 1, "lm_head.w": 2}, prefix="model."))
        ['w']
    """
    mapped: dict = {}
    for key, entry in entries.items():
        if prefix:
            if not key.startswith(prefix):
                continue
            key = key[len(prefix):]
        if rename is not None:
            new = rename(key)
            if new is None:
                continue
            if not isinstance(new, str):
                raise TypeError(f"rename({key!r}) returned {type(new).__name__}; return a str, or None to skip the key")
            key = new
        if key in mapped:
            raise CheckpointError(
                f"two checkpoint keys become {key!r} ({_key_of(mapped[key])!r} and {_key_of(entry)!r}); "
                "check prefix= and rename=."
            )
        mapped[key] = entry
    return mapped


def _key_of(entry) -> str:
    return getattr(entry, "key", entry)


def map_metadata(metadata, *, prefix: str = "", rename=None):
    """A state dict's ``_metadata`` (module versions, by module prefix) for the
    keys after ``prefix``; None when ``rename`` makes module names unknowable."""
    if metadata is None or rename is not None:
        return None
    if not prefix:
        return metadata
    head = prefix[:-1] if prefix.endswith(".") else prefix
    out = type(metadata)()
    for key, value in metadata.items():
        if key == head:
            out[""] = value
        elif key.startswith(head + "."):
            out[key[len(head) + 1:]] = value
    return out


def result_of(module, missing, unexpected, errors, *, strict: bool, source: str, mapped, prefix: str = "", keys=()) -> LoadResult:
    """The call's :class:`LoadResult`, or :class:`CheckpointMismatchError` for
    ``errors`` (size mismatches...), or missing/unexpected keys when ``strict``
    (``keys``: the checkpoint's keys before ``prefix``, for the hint)."""
    tensors = dict(module_keys(module))
    missing = forgive_ties(missing, tensors)
    problems = []
    if errors:
        problems.append(shorten(errors, "; "))
    if strict and missing:
        problems.append(f"{_count(missing, 'missing key')}: " + shorten([repr(k) for k in missing]))
    if strict and unexpected:
        problems.append(f"{_count(unexpected, 'unexpected key')}: " + shorten([repr(k) for k in unexpected]))
    if problems:
        hint = prefix_hint(missing, unexpected, set(tensors), set(mapped), prefix)
        if prefix and not mapped and keys:
            # The prefix took every key away: what would the keys themselves need?
            hint = f" prefix={prefix!r} matches none of the checkpoint's {len(keys)} keys." + (
                prefix_hint(missing, list(keys), set(tensors), set(keys)) or f" Its keys: {shorten([repr(k) for k in keys], shown=3)}."
            )
        if not hint and not errors:
            hint = " Pass strict=False to load the keys that match, or prefix=/rename= to map names."
        raise CheckpointMismatchError(
            f"cannot load {source or 'the checkpoint'} into {type(module).__name__}: "
            + "; ".join(problems) + f". Nothing was loaded or recorded.{hint}"
        )
    return LoadResult(missing, unexpected)


def forgive_ties(missing, tensors: dict) -> list:
    """``missing`` without the names of tied tensors the checkpoint has under
    another of their names (``tensors``: module key -> tensor).

    Example::

        >>> w = torch.ones(2)
        >>> forgive_ties(["head.weight", "norm.weight"], {"wte.weight": w, "head.weight": w, "norm.weight": torch.ones(2)})
        ['norm.weight']
    """
    absent = set(missing)
    names: dict = {}
    for key, t in tensors.items():
        names.setdefault(id(t), []).append(key)
    return [k for k in missing if k not in tensors or all(n in absent for n in names[id(tensors[k])])]


def _count(keys, what: str) -> str:
    return f"{len(keys)} {what}{'' if len(keys) == 1 else 's'}"


def shorten(items, sep: str = ", ", shown: int = SHOWN) -> str:
    """The first ``shown`` of ``items`` and how many more.

    Example::

        >>> shorten([repr(k) for k in "abcdefg"], shown=3)
        "'a', 'b', 'c' and 4 more"
    """
    items = [str(i).rstrip(". ") for i in items]
    if len(items) <= shown:
        return sep.join(items)
    return sep.join(items[:shown]) + f" and {len(items) - shown} more"


def prefix_hint(missing, unexpected, module_names: set, checkpoint_names: set, prefix: str = "") -> str:
    """What a common prefix explains: the checkpoint's keys are the module's with
    a prefix in front (``prefix=`` takes it off), or without one the module's
    keys have (``rename=`` puts it on); "" when no prefix explains most of the
    missing keys.

    Example::

        >>> prefix_hint(["w", "b"], ["model.w", "model.b", "lm_head.w"], {"w", "b"}, {"model.w", "model.b", "lm_head.w"})
        " The checkpoint's keys are the module's with 'model.' in front (2 of the 2 missing keys are in it as 'model.' + key): pass prefix='model.'."
    """
    if not missing:
        return ""
    heads = set()  # the checkpoint has "p" + a module key
    for key in unexpected:
        for p in _heads(key):
            if key[len(p):] in module_names:
                heads.add(p)
    # Counted over the missing keys, not the checkpoint's: a key loaded another
    # way (a tie's other name, an unprefixed copy) is not missing.
    added = Counter({p: sum(p + key in checkpoint_names for key in missing) for p in heads})
    removed = Counter()  # the module has "p" + a checkpoint key
    for key in missing:
        for p in _heads(key):
            if key[len(p):] in checkpoint_names:
                removed[p] += 1
    need = (len(missing) + 1) // 2
    if added:
        p, n = added.most_common(1)[0]
        if n >= need:
            return (
                f" The checkpoint's keys are the module's with {p!r} in front ({n} of the {len(missing)} missing "
                f"keys are in it as {p!r} + key): pass prefix={prefix + p!r}."
            )
    if removed:
        p, n = removed.most_common(1)[0]
        if n >= need:
            return (
                f" The module's keys are the checkpoint's with {p!r} in front ({n} of the {len(missing)} missing "
                f"keys are in it without {p!r}): pass rename=lambda k: {p!r} + k."
            )
    return ""


def _heads(key: str):
    """The dotted prefixes of ``key``: ``"a."``, ``"a.b."``... (not the whole key)."""
    at = key.find(".")
    while at != -1:
        yield key[: at + 1]
        at = key.find(".", at + 1)
