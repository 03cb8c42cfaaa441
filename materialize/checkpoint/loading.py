"""Loads of one ``load_checkpoint`` call: recorded on deferred tensors, read into real ones.

A deferred tensor gets a *load node*: a write of its whole value, whose
payload is the checkpoint entry.  It hides every earlier write to the
tensor (its initialisation), and replay reads the file then, only the
parts that are read (see :mod:`deferinit.ir.liveness`).  A sharded tensor
(a DTensor, from ``fully_shard``, ``distribute_tensor`` or
``parallelize_module``) gets the load of the block its placements give this
rank, so each rank reads its own rows only.  A real tensor is loaded from
memory of its own: its bytes are read first (*staged*), and written into
the tensor only once every read of the call succeeded.

A :class:`Loader` holds the loads of one call, in the order
``load_state_dict``'s walk makes them (:mod:`.capture`): deferred ones are
recorded at once, real ones wait until the walk ends or until something
touches their tensor.  A hook's other writes into the module's tensors
(``param[:3].copy_(x)``, ``fill_``) run as they come, each tensor's old
state kept first (a :class:`Guard`).  :meth:`Loader.undo` takes all of them
back: a call that fails leaves every tensor as it was.  A load copied from a
tensor in memory reads it as it is at the ``copy_``, as eager's ``copy_``
does, even if the walk writes into that tensor afterwards
(:meth:`Loader.source_written`).
"""

from __future__ import annotations

import torch

from deferinit.errors import RecordingError
from deferinit.ir.graph import Input, Node
from deferinit.recorder import check_storage_not_real, is_deferred_fake
from deferinit.fake import is_fake
from deferinit.fake.flat import flatten

from .errors import CheckpointError, CheckpointReadError
from .blocks import local_block
from .capture import is_dtensor, storage_key
from .entries import MemorySource, read_now
from .files import Source
from .sources import DeferredValue
from .undo import Guard, keep, put_back

_SPEC = flatten((None,), {})[1]


def record_load(fake: torch.Tensor, entry) -> Node:
    """Record that ``fake``'s values are ``entry``'s (a write of its whole value).

    Example::

        >>> from deferinit.materialize.checkpoint.entries import MemorySource
        >>> m = deferred_init(torch.nn.Linear, 2, 2)
        >>> node = record_load(m.bias, MemorySource.entry("bias", torch.ones(2)))
        >>> node.kind, materialize_tensor(m.bias).tolist()
        ('load', [1.0, 1.0])
    """
    storage = fake._storage
    node = Node("load", None, [Input(fake._value, storage.head)], _SPEC, payload=entry)
    node.writes = (0,)
    storage.head = node
    torch._C._increment_version((fake,))
    return node


_INFERENCE = (
    "cannot load {key}: it is an inference tensor (made under torch.inference_mode()) and this call "
    "is outside inference mode, where load_state_dict refuses it too (\"Inplace update to inference "
    "tensor outside InferenceMode is not allowed\"). Call load_checkpoint inside "
    "torch.inference_mode(), or build the module outside it. Nothing was loaded or recorded."
)


class Load:
    """One tensor of the module loaded from one checkpoint tensor; checked when made.

    Example::

        >>> m = torch.nn.Linear(2, 2)
        >>> load = Load("bias", m.bias, MemorySource.entry("bias", torch.ones(2)))
        >>> load.stage(); load.commit()
        >>> m.bias.tolist()
        [1.0, 1.0]
    """

    def __init__(self, key: str, tensor: torch.Tensor, entry):
        self.key = key
        self.tensor = tensor
        target = tensor
        start = None
        if is_dtensor(tensor):
            target = tensor._local_tensor
            start, sizes = local_block(key, tensor)
            if not isinstance(entry.source, DeferredValue):
                entry = entry.box(start, sizes)
        self.target, self.start = target, start
        self.deferred = is_deferred_fake(target)
        geometry = target.__dict__.get("_shadow", target) if is_fake(target) else target
        if torch._debug_has_internal_overlap(geometry) == 1:
            # copy_ (and so load_state_dict) refuses to write such a tensor.
            raise CheckpointError(
                f"cannot load {key}: more than one of its elements refer to a single memory "
                "location (an expanded tensor); load_state_dict refuses it too."
            )
        if target.is_inference() and not torch.is_inference_mode_enabled():
            raise CheckpointError(_INFERENCE.format(key=key))
        deferred_source = isinstance(entry.source, DeferredValue)
        if self.deferred:
            try:
                check_storage_not_real(target, "load_checkpoint")
            except RecordingError as e:
                raise CheckpointError(f"cannot load {key}: {e}") from None
            if isinstance(entry.source, MemorySource):
                entry = entry.kept()  # as if copied now
        elif is_fake(target):
            raise CheckpointError(
                f"cannot load {key}: it is a fake tensor from fake_mode, not deferred; its values could "
                "never be materialized. Build the module with deferred_init."
            )
        elif target.is_meta:
            raise CheckpointError(
                f"cannot load {key}: it is on the meta device, which holds no values. Build the module "
                "with deferred_init (or call to_empty() first)."
            )
        elif deferred_source:
            raise CheckpointError(
                f"cannot load the deferred state dict value {key!r} into a real tensor; materialize it first."
            )
        self.entry = entry
        self.staged = None
        self.backup = None
        self.committed = False
        self.head = None
        self.node = None

    # -- deferred ------------------------------------------------------------------

    def record(self) -> None:
        """Record the load (a deferred tensor)."""
        storage = self.target._storage
        self.head = (storage, storage.head)
        if isinstance(self.entry.source, DeferredValue):
            piece = self.entry.source.tensor
            if self.start is not None:
                for dim, (i, n) in enumerate(zip(self.start, self.target.shape)):
                    piece = piece.narrow(dim, i, n)
            with torch.no_grad():
                self.target.copy_(piece)
        else:
            self.node = record_load(self.target, self.entry)

    def snapshot(self) -> None:
        """Read the values now: the walk is about to write where they are."""
        values = self.entry.source.view(self.entry).clone()
        self.entry = MemorySource.entry(self.entry.key, values)
        if self.node is not None:
            self.node.payload = self.entry

    # -- real ------------------------------------------------------------------------

    def stage(self) -> None:
        """Read what a real tensor will get (nothing is written yet)."""
        if isinstance(self.entry.source, MemorySource):
            try:
                self.entry.check()  # a hook may have changed it since it was given
            except CheckpointReadError as e:
                raise CheckpointError(str(e).split(" Nothing was changed")[0] + " Nothing was loaded.") from None
            return
        buffer = torch.empty(tuple(self.target.shape), dtype=self.target.dtype, device="cpu")
        read_now(self.entry, buffer)
        self.staged = buffer

    def commit(self, keep_old: bool = False) -> None:
        """Write the staged values into the real tensor (``keep_old``: so that
        :meth:`undo` can put the old ones back)."""
        if self.committed:
            return  # written already (a roll forward after an interrupt, see Loader.roll_forward)
        target = self.target
        counted = not target.is_inference()
        before = target._version if counted else None
        if keep_old:
            self.backup = keep(target)
        with torch.no_grad():
            if self.staged is not None:
                target.copy_(self.staged)
                self.staged = None
            else:
                target.copy_(self.entry.source.view(self.entry))
        self.committed = True
        if counted and target._version == before:
            # Written inside the walk's dispatch mode, below the layer that
            # counts versions: count it as eager's copy_ does.
            torch._C._increment_version((target,))

    def undo(self) -> None:
        put_back(self.head, self.backup)
        self.staged = self.backup = self.head = None


class Loader:
    """The loads of one call: deferred ones recorded at once, real ones staged and
    written when the walk ends (or earlier, when something touches their tensor);
    :meth:`undo` takes every one back."""

    def __init__(self):
        self.pending: dict = {}
        self.done: list = []
        self.committing = None  # the loads finish() writes, once every read succeeded
        self._guarded: set = set()
        # Loads copied from tensors in memory, by the memory they read (see
        # source_written): real ones still pending, deferred ones kept by reference.
        self._readers: dict = {}
        self.sources: dict = {}  # id -> (file source, the entries of its loads)

    def need(self) -> None:
        """What the loads will read, read and checked now, after the walk (not under
        its dispatch mode), each source at once: a rank's blocks, not the whole files."""
        for source, entries in self.sources.values():
            source.need(entries)

    def add(self, key: str, tensor: torch.Tensor, entry) -> None:
        load = Load(key, tensor, entry)
        if isinstance(load.entry.source, Source):
            self.sources.setdefault(id(load.entry.source), (load.entry.source, []))[1].append(load.entry)
        if isinstance(load.entry.source, MemorySource):
            self._readers.setdefault(load.entry.source.memory_key(), []).append(load)
        if load.deferred:
            self.done.append(load)  # first: undo takes back a record an interrupt cut short
            load.record()
            return
        self.pending.setdefault(self._group(load), []).append(load)

    @staticmethod
    def _group(load) -> tuple:
        skey = storage_key(load.target)
        return skey if skey is not None else ("object", id(load.target))

    def flush(self, t) -> None:
        """Write the pending loads of ``t``'s memory now (the walk reads it)."""
        if not self.pending:
            return
        key = storage_key(t)
        loads = self.pending.pop(key, None) if key is not None else None
        if loads is None and is_dtensor(t):
            loads = self.pending.pop(storage_key(t._local_tensor), None)
        self._write_now(loads or ())

    def _write_now(self, loads) -> None:
        for load in loads:
            load.stage()
            self.done.append(load)  # first: undo takes back a write an interrupt cut short
            if not load.committed:
                self._snapshot_readers(storage_key(load.target))
            load.commit(keep_old=True)

    def _snapshot_readers(self, key) -> None:
        """The deferred loads that read the memory ``key`` names, read now: it is
        about to be written (they were copied before, and read it as it was)."""
        readers = self._readers.get(key)
        if readers:
            for load in [load for load in readers if load.deferred]:
                load.snapshot()  # from now on it reads a copy of its own
                readers.remove(load)

    def guard(self, tensor: torch.Tensor) -> None:
        """``tensor`` (one of the module's) is about to be written in place by the
        walk, not by a load: keep what it holds for :meth:`undo` (once a call)."""
        if id(tensor) not in self._guarded:
            self._guarded.add(id(tensor))
            self.done.append(Guard(tensor))

    def source_written(self, t) -> None:
        """``t``'s memory is about to be written in place: the loads copied from it
        read it now, as eager's ``copy_`` read it at its call."""
        key = storage_key(t)
        if key is None or not self._readers.get(key):
            return
        for load in [load for load in self._readers[key] if not load.deferred]:
            if load in self.pending.get(self._group(load), ()):  # not written yet
                self._write_now(self.pending.pop(self._group(load)))
        self._snapshot_readers(key)

    def finish(self) -> None:
        """Stage every pending load, then write them all: no write before every read succeeded."""
        loads = [load for group in self.pending.values() for load in group]
        last = {id(load.target): i for i, load in enumerate(loads)}
        # A later load of the same tensor hides an earlier one (a tied tensor under two names).
        loads = [load for i, load in enumerate(loads) if last[id(load.target)] == i]
        for load in loads:
            load.stage()
        # Every read succeeded: from here on the call is written through, also
        # when an interrupt arrives in the writes (roll_forward).
        self.committing = loads
        self._write_all()

    def _write_all(self) -> None:
        for load in self.committing:
            if not load.committed:
                self._snapshot_readers(storage_key(load.target))
                load.commit()
        self.pending.clear()
        seen = {id(d) for d in self.done}
        self.done.extend(load for load in self.committing if id(load) not in seen)

    def roll_forward(self) -> None:
        """An interrupt while :meth:`finish` wrote: write the rest (every value is
        staged already), so that the call is entirely done."""
        self._write_all()

    def undo(self) -> None:
        for load in reversed(self.done):
            load.undo()
        self.done.clear()
        self.pending.clear()
        self._readers.clear()
