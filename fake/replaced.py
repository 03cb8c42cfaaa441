"""Every attribute of torch this project may replace: which, why, and when it is put back.

deferinit is a guest in the user's process.  Importing it replaces nothing;
once no fake tensor is alive, every attribute below is PyTorch's own object
again.  In between, PyTorch's protocols come first (torch-function and
dispatch modes, which are per thread and scoped to a ``with`` block; the
wrapper-subclass protocol on our own ``FakeTensor``;
``torch.utils.swap_tensors``' exchange), and an attribute is replaced only
where no protocol sees the call, for as short as the guarantee that needs
it.  Each entry of :data:`TABLE` is one such replacement: the object whose
attributes are replaced, their names, why no protocol serves, and when the
original is put back.  :class:`~deferinit.fake.patch.SharedPatch` installs
only names listed here (it refuses others), and ``tests/test_guest.py``
compares a snapshot of torch before, during and after deferrals,
materializations, failures and interrupts against this table.

Example::

    >>> TABLE["tensor data"].names
    ('data', 'set_')
    >>> sorted(TABLE)[:3]
    ['fsdp1 hooks', 'generator api', 'make subclass']
"""

from __future__ import annotations

from dataclasses import dataclass

#: ``names`` of an entry whose names are every ATen op with a ``generator``
#: argument (computed by ``deferinit.random.pending.random_ops``).
RANDOM_OPS = "every function or method of an ATen op that takes a generator"


@dataclass(frozen=True)
class Replacement:
    """Attributes ``names`` of ``owner`` replaced by ``by``, ``why``, and ``until``."""

    owner: tuple  # dotted names of the objects whose attributes are replaced
    names: tuple | str  # attribute names, or RANDOM_OPS
    by: str  # the module that installs them
    why: str  # why no protocol of PyTorch serves
    until: str  # when they are installed, and when the originals are back

    def allows(self, name: str) -> bool:
        """Whether this entry lists ``name`` (every name, for RANDOM_OPS: checked by the test)."""
        return self.names == RANDOM_OPS or name in self.names


TABLE = {
    "tensor data": Replacement(
        owner=("torch.Tensor",),
        names=("data", "set_"),
        by="deferinit.fake.assign",
        why="``real.data = fake`` and ``real.set_(fake, ...)`` go to C++ without asking the class of the "
        "fake argument (torch-function dispatch looks at ``self`` only, and no mode is active after "
        "deferred_init returns); C++ would give the real tensor a fake's missing memory and crash "
        "at the first kernel that reads it.",
        until="held by every fake tensor alive (deferinit.fake.alive): installed when the first fake "
        "is made, put back when the last one dies (materialized or collected).",
    ),
    "make subclass": Replacement(
        owner=("torch.Tensor",),
        names=("_make_subclass",),
        by="deferinit.fake.subclass",
        why="``torch.Tensor._make_subclass(cls, fake)`` (Parameter subclasses with a __new__ of their "
        "own, lazy modules' placeholders) is on torch.overrides' list of functions that bypass "
        "torch-function modes; C++ would bind a second Python object to the fake.",
        until="while any thread is inside a fake mode (deferred_init, deferred(), fake_mode) and while "
        "any fake is alive (a deferred model meets these classes after the block too: transformers' "
        "quantizers make Int8Params of its weights); it hands anything but a fake to PyTorch's own.",
    ),
    "trunc normal": Replacement(
        owner=("torch.nn.init",),
        names=("_no_grad_trunc_normal_",),
        by="deferinit.patches",
        why="``nn.init.trunc_normal_`` samples by rejection (a loop on ``mask.any()``) and has no "
        "torch-function prologue, so no mode sees the call as a whole; its worker, looked up in "
        "torch.nn.init's globals at each call, is recorded as one opaque call.",
        until="while any thread records; deferred fakes only, everything else goes to the original.",
    ),
    "generator api": Replacement(
        owner=("torch", "torch.random", "torch.cuda", "torch.cuda.random"),
        names=(
            "manual_seed", "seed", "initial_seed", "get_rng_state", "set_rng_state",
            "manual_seed_all", "seed_all", "get_rng_state_all", "set_rng_state_all",
        ),
        by="deferinit.random.seeding",
        why="torch's Python generator API is plain Python calling C methods of torch.Generator: no "
        "protocol sees it.  While recording, the recording thread's seeds and reads become the "
        "record's events (nothing another thread sees changes); after a deferral, a reseed "
        "(even to the same seed or state) tells materialization not to move the generator past "
        "draws that eagerly the reseed wiped out.",
        until="while any thread records, and while a closed record's draws on a default generator "
        "wait for their hand-over: until it happened, a reseed made it moot, or the record died.",
    ),
    "module classes": Replacement(
        owner=("torch", "torch._C", "torch.random"),
        names=("__class__",),
        by="deferinit.random.seeding",
        why="``torch.default_generator`` is a plain module attribute; a module class with a "
        "``default_generator`` property is the one way to answer the recording thread with its own "
        "view of the generator while every other thread keeps the real object.",
        until="while any thread records.",
    ),
    "pending draws": Replacement(
        owner=("torch", "torch.Tensor"),
        names=RANDOM_OPS,
        by="deferinit.random.pending",
        why="a real draw from a default generator whose deferred draws are pending differs from "
        "eager; only the Python entry points of random ops see it when it happens (a mode would "
        "put every torch call of the process through Python), so that PendingDrawsWarning names it.",
        until="from a deferral's end while its draws may still be pending: until it warned, a seed "
        "was set, its generators moved, or the record died.",
    ),
    "fsdp1 hooks": Replacement(
        owner=("torch.distributed.fsdp._init_utils",),
        names=("_TORCHDISTX_AVAIL", "fake", "deferred_init"),
        by="deferinit.materialize.fsdp1",
        why="FSDP1 recognises deferred modules only through torchdistX's module names in its own globals.",
        until="inside ``with fsdp1_hooks():`` only.",
    ),
    "planner cuda runtime": Replacement(
        owner=("torch.cuda",),
        names=("Stream", "Event", "current_stream", "stream", "current_device"),
        by="deferinit.planning.process_group",
        why="planning a sharded step (``deferinit plan --shard``) on a build without CUDA: FSDP2's stream "
        "and event calls on torch.cuda answered by torch.cpu's.",
        until="inside ``with fake_ranks(..., \"cuda\"):`` on a build without CUDA only (the planner, "
        "never deferral or materialization).",
    ),
}


def entry(key: str, owner: str, names) -> Replacement:
    """The entry ``key`` of :data:`TABLE`, checked to list ``names`` of ``owner``.

    Example::

        >>> entry("trunc normal", "torch.nn.init", ["_no_grad_trunc_normal_"]).by
        'deferinit.patches'
    """
    found = TABLE[key]
    unlisted = [n for n in names if not found.allows(n)]
    if owner not in found.owner or unlisted:
        raise AssertionError(f"{owner}.{unlisted or list(names)} is not listed in deferinit.fake.replaced.TABLE[{key!r}]")
    return found
