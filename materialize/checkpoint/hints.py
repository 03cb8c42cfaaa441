"""What to say when a checkpoint's keys do not match and the module rewrites keys itself.

``load_state_dict`` runs a module's load_state_dict pre-hooks on the state
dict before matching keys: torchtitan's ``FusedQKVLinear`` merges the
``wq``/``wk``/``wv`` its ``state_dict`` hook wrote back into its fused
``wqkv``.  ``load_checkpoint`` matches the checkpoint's keys to the
module's tensors as they are named, so such a checkpoint has keys the
module lacks and lacks keys the module has; the mismatch error then names
the hooks and what to do.

Example::

    >>> pre_hook_hint(titan_model)
    " The module has load_state_dict pre-hooks that rewrite keys ... FusedQKVLinear._merge_qkv_on_load ..."
"""

from __future__ import annotations

import torch


def pre_hook_hint(module: torch.nn.Module, limit: int = 3) -> str:
    """A sentence naming ``module``'s load_state_dict pre-hooks, or ``""`` when it has none."""
    found = {}
    for name, sub in module.named_modules():
        for hook in getattr(sub, "_load_state_dict_pre_hooks", {}).values():
            fn = getattr(hook, "hook", hook)
            label = getattr(fn, "__qualname__", type(fn).__name__)
            found.setdefault(label, name or type(module).__name__)
    if not found:
        return ""
    named = ", ".join(f"{label} (on {where})" for label, where in list(found.items())[:limit])
    more = f" and {len(found) - limit} more" if len(found) > limit else ""
    return (
        f" The module has load_state_dict pre-hooks that rewrite a state dict's keys before "
        f"load_state_dict matches them: {named}{more}; load_checkpoint matches the checkpoint's keys "
        "to the module's parameters and buffers as they are named, without them. Load a checkpoint "
        "saved in that layout (the keys of named_parameters()), or rewrite this one with the hook "
        "first (e.g. torch.distributed.checkpoint.format_utils.dcp_to_torch_save, the hook on the "
        "loaded dict, then save it)."
    )
