"""``load_checkpoint`` runs the module's own ``load_state_dict``, on stand-ins.

Whatever a module does when it loads (``_load_from_state_dict`` overrides
such as BatchNorm's, which fills in a missing ``num_batches_tracked``; the
pre-hook of lazy modules, which gives their parameters the checkpoint's
shapes; any ``register_load_state_dict_pre_hook`` or post-hook, transformers'
and FSDP2's included) happens because PyTorch's own walk runs, on a state
dict whose values *stand in* for the checkpoint's tensors: a file's tensor
as a meta tensor of its geometry (nothing is read), a state dict's tensor,
real or deferred, as itself.  A dispatch mode (:class:`Capture`) watches the
walk, in this thread only:

* a ``copy_`` into one of the module's tensors (``param.copy_(input_param)``,
  or through ``.data``) does not run: it becomes a *load* of that tensor
  (:mod:`.loading`) from the checkpoint tensor its source stands for;
* a view of a stand-in (``input_param[0]``, a hook's ``.t()`` or ``split``)
  is a view of the same meta storage: a piece of the same checkpoint
  tensor, still unread;
* any other operation on a stand-in computes on its values: they are read
  then, and a write into a stand-in makes it real from there on;
* an operation touching a module tensor whose load is pending runs that
  load first, so a hook reads the values it would read eagerly;
* any other in-place write into a module tensor (a hook's
  ``param[:3].copy_(x)``, ``fill_``) runs, the tensor's state kept first so
  that a failed call puts it back; a write into a tensor a load was copied
  from makes that load read it first (eager's ``copy_`` read it then).

Example::

    >>> m = torch.nn.BatchNorm1d(2)
    >>> missing, unexpected = load_checkpoint(m, {"weight": torch.ones(2), "bias": torch.ones(2),
    ...     "running_mean": torch.ones(2), "running_var": torch.ones(2)})   # no num_batches_tracked
    >>> missing, int(m.num_batches_tracked)
    ([], 0)
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from deferinit.plain import plain
from deferinit.recorder import is_deferred_fake
from deferinit.fake import is_fake
from deferinit.fake.bypass import no_python_dispatch
from deferinit.fake.extent import extent
from deferinit.fake.opinfo import op_info

from .errors import CheckpointError
from .entries import Entry, MemorySource, read_now
from .sources import DeferredValue

aten = torch.ops.aten

# load_state_dict's own error, with its messages one per line after this.
_ERRORS = "Error(s) in loading state_dict for "


def storage_key(t):
    """What identifies ``t``'s memory: a deferred fake's recorded storage, a real
    or meta tensor's storage; None for other tensor subclasses (DTensor)."""
    d = getattr(t, "__dict__", None)
    if is_fake(t):
        s = d.get("_storage") if d is not None else None
        return ("fake", id(s)) if s is not None else None
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        return None
    try:
        return (t.device.type, t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):
        return None


def is_dtensor(t) -> bool:
    """Whether ``t`` is a DTensor (without importing torch.distributed)."""
    return getattr(t, "_local_tensor", None) is not None and hasattr(t, "device_mesh")


def geometry(t) -> tuple:
    """What a view's identity is made of besides its memory."""
    return (t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())


class _Root:
    __slots__ = ("entry", "base", "real")

    def __init__(self, entry, base):
        self.entry = entry
        self.base = base  # the meta tensor over the whole extent (keeps the storage alive)
        self.real = None  # its values, once a write made the stand-in real


class StandIns:
    """Meta tensors standing for checkpoint tensors, and what their views stand for.

    Example::

        >>> import os, tempfile
        >>> from safetensors.torch import save_file
        >>> from deferinit.materialize.checkpoint.sources import open_file
        >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
        >>> save_file({"w": torch.arange(6.0).reshape(2, 3)}, path)
        >>> s = StandIns()
        >>> t = s.make(open_file(path)["w"])          # nothing read
        >>> column = s.entry(t.t()[1])                # a view: still the file's, elements 1 and 4
        >>> column.shape, column.offset, column.strides, s.real(t.t()[1]).tolist()
        ((2,), 1, (3,), [1.0, 4.0])
    """

    def __init__(self):
        self._roots: dict = {}

    def make(self, entry: Entry) -> torch.Tensor:
        if isinstance(entry.source, (MemorySource, DeferredValue)):
            return entry.source.tensor
        with no_python_dispatch():
            base = torch.empty(extent(entry.shape, entry.strides, entry.offset), dtype=entry.dtype, device="meta")
            t = base.as_strided(entry.shape, entry.strides, entry.offset)
        self._roots[storage_key(base)] = _Root(entry, base)
        return t

    @property
    def files(self) -> bool:
        """Whether any stand-in is a file's tensor (a meta tensor)."""
        return bool(self._roots)

    def root(self, t):
        if (type(t) is torch.Tensor or type(t) is torch.nn.Parameter) and t.is_meta:
            return self._roots.get(storage_key(t))
        return None

    def owns(self, t) -> bool:
        return self.root(t) is not None

    def entry(self, t: torch.Tensor) -> Entry:
        """The checkpoint tensor ``t`` (a stand-in, or a view of one) stands for."""
        root = self.root(t)
        e = root.entry
        if root.real is None and t.dtype == e.dtype:
            return Entry(e.source, e.key, t.dtype, t.shape, e.base, t.storage_offset(), t.stride())
        return MemorySource.entry(e.key, self.real(t).clone())

    def real(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s values, read now (on the CPU)."""
        root = self.root(t)
        with no_python_dispatch():
            if root.real is None and t.dtype == root.entry.dtype:
                out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                read_now(self.entry(t), out)
                return out
            self.promote(t)
            return torch.empty(0, dtype=t.dtype).set_(root.real.untyped_storage(), t.storage_offset(), t.shape, t.stride())

    def promote(self, t: torch.Tensor) -> None:
        """Read ``t``'s whole checkpoint tensor into memory of its own: written from now on."""
        root = self.root(t)
        if root.real is None:
            e = root.entry
            with no_python_dispatch():
                real = torch.empty(root.base.numel(), dtype=e.dtype, device="cpu")
                read_now(e, real.as_strided(e.shape, e.strides, e.offset))
            root.real = real


class Targets:
    """The module's parameters and buffers, found from any tensor on their memory
    with their geometry (``param.data`` is another object on the same memory)."""

    def __init__(self, module: torch.nn.Module):
        self.names: dict = {}
        self._by_id: dict = {}
        self._by_storage: dict = {}
        for name, t in itertools.chain(
            module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)
        ):
            if t is None or id(t) in self._by_id:
                continue
            self.names[id(t)] = name
            self._by_id[id(t)] = t
            if not torch.nn.parameter.is_lazy(t):
                key = storage_key(t)
                if key is not None:
                    self._by_storage.setdefault(key, []).append(t)

    def find(self, t):
        """The module tensor ``t`` is (itself, or another object on its memory with its geometry)."""
        found = self._by_id.get(id(t))
        if found is not None:
            return found
        key = storage_key(t)
        for candidate in self._by_storage.get(key, ()) if key is not None else ():
            if not torch.nn.parameter.is_lazy(candidate) and geometry(candidate) == geometry(t):
                return candidate
        return None

    def owners(self, t) -> list:
        """The module tensors on the memory ``t`` is on (``t`` itself, its views, or
        every tensor packed in the same memory)."""
        key = storage_key(t._local_tensor if is_dtensor(t) else t)
        found = list(self._by_storage.get(key, ())) if key is not None else []
        if not found and id(t) in self._by_id:
            found.append(self._by_id[id(t)])
        return found


class Capture(TorchDispatchMode):
    """Watches ``load_state_dict``'s walk: copies into the module's tensors become
    loads (``loader.add``), operations on stand-ins read them when they must."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # No torch.compile runs inside the handler: without this, PyTorch wraps
        # it to disable dynamo, and the wrapper imports torch._dynamo (seconds).
        return False

    def __init__(self, standins: StandIns, targets: Targets, loader):
        super().__init__()
        self.standins = standins
        self.targets = targets
        self.loader = loader
        self.refused: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.copy_.default and len(args) >= 2:
            target = self.targets.find(args[0])
            if target is not None:
                self._flush(args[1])
                if args[1] is not args[0]:
                    self._load(target, args[1])
                return args[0]
        leaves = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        for x in leaves:
            self._flush(x)
        info = op_info(func)
        if info.writes:
            self._before_writes(info.written(args, kwargs))
        standing = [x for x in leaves if self.standins.owns(x)]
        if not standing:
            return func(*args, **kwargs)
        if info.view_arg is not None and not info.writes:
            with no_python_dispatch():
                return func(*args, **kwargs)
        try:
            return self._compute(func, info, args, kwargs, standing)
        except CheckpointError as e:  # a failed read: refused even if a try of the walk catches it
            self.refused.append(e)
            raise

    def _flush(self, t) -> None:
        try:
            self.loader.flush(t)
        except CheckpointError as e:
            self.refused.append(e)
            raise

    def _before_writes(self, written) -> None:
        """Before an in-place write that is not a load: keep the old state of the
        module tensors it writes, and let loads copied from its memory read it."""
        for w in written:
            if self.standins.owns(w):
                continue  # a stand-in becomes real memory of its own (_compute)
            try:
                self.loader.source_written(w)
            except CheckpointError as e:
                self.refused.append(e)
                raise
            for target in self.targets.owners(w):
                self.loader.guard(target)

    def _load(self, target, src) -> None:
        name = self.targets.names[id(target)]
        try:
            if tuple(src.shape) != tuple(target.shape):
                src = src.expand(target.shape)  # copy_ broadcasts; this raises as it would
            self.loader.add(name, target, self._entry(name, src))
        except CheckpointError as e:
            self.refused.append(e)
            raise

    def _entry(self, name, src) -> Entry:
        if self.standins.owns(src):
            return self.standins.entry(src)
        if is_deferred_fake(src):
            return Entry(DeferredValue(src), name, src.dtype, src.shape, 0, 0, src.stride())
        if is_fake(src):
            raise CheckpointError(f"cannot load {name}: its value is a fake tensor from fake_mode, whose values are unknown.")
        if src.is_meta:
            raise CheckpointError(f"cannot load {name}: its value is on the meta device, which holds no values.")
        return MemorySource.entry(name, plain(src))

    def _compute(self, func, info, args, kwargs, standing):
        written = {id(w) for w in info.written(args, kwargs)}
        swap = {}
        for x in standing:
            if id(x) in written:
                self.standins.promote(x)
            swap[id(x)] = self.standins.real(x)
        real = tree_map(lambda y: swap.get(id(y), y) if isinstance(y, torch.Tensor) else y, (args, kwargs))
        out = func(*real[0], **real[1])
        back = {id(swap[id(x)]): x for x in standing}
        for x in standing:
            r = swap[id(x)]
            if id(x) in written and geometry(r)[1:] != geometry(x)[1:]:
                with no_python_dispatch():  # t_(), squeeze_(): the stand-in follows
                    x.as_strided_(r.shape, r.stride(), r.storage_offset())
        return tree_map(lambda y: back.get(id(y), y) if isinstance(y, torch.Tensor) else y, out)


def walk(module: torch.nn.Module, state_dict: dict, metadata, capture: Capture):
    """Run ``module.load_state_dict`` on ``state_dict`` under ``capture``:
    ``(missing, unexpected, errors)``, ``errors`` being ``load_state_dict``'s
    own messages (size mismatches...)."""
    sd = OrderedDict(state_dict)
    if metadata is not None:
        sd._metadata = metadata
    try:
        with capture:
            result = module.load_state_dict(sd, strict=False)
    except Exception as e:
        if capture.refused:
            raise capture.refused[0] from None
        text = str(e)
        if isinstance(e, RuntimeError) and text.startswith(_ERRORS):
            return [], [], text.split("\n\t")[1:]
        if capture.standins.files and not isinstance(e, CheckpointError):
            e.add_note(
                f"load_checkpoint ran {type(module).__name__}.load_state_dict with a file's tensors standing in "
                "as meta tensors (nothing read yet): code that needs their values outside PyTorch's operators "
                "(.numpy(), .data_ptr()) or checks their device fails on them. Pass the file's state dict "
                "instead: load_checkpoint(module, safetensors.torch.load_file(path)). Nothing was loaded."
            )
        raise
    if capture.refused:
        raise capture.refused[0]
    return list(result.missing_keys), list(result.unexpected_keys), []


def leaked(module: torch.nn.Module, standins: StandIns) -> str | None:
    """The name of a module tensor or tensor attribute that is a stand-in itself
    (a hook kept the checkpoint's tensor instead of copying it), if any."""
    for name, t in itertools.chain(module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)):
        if t is not None and standins.owns(t):
            return name
    if standins.files:
        for prefix, sub in module.named_modules(remove_duplicate=False):
            for attr, value in vars(sub).items():
                if isinstance(value, torch.Tensor) and standins.owns(value):
                    return f"{prefix}.{attr}" if prefix else attr
    return None
