"""Running operators on fake tensors: swap fakes for shadows, run the meta
kernel, wrap the meta outputs as fakes on the right device.

:func:`run` is the single place where that happens; :class:`FakeHandler`
puts it behind the small interface the modes and ``FakeTensor`` call, and
the recorder of ``deferinit`` extends that interface.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import handlers
from .device import CPU, META, common_device, normalize
from .errors import FakeDataAccessError
from .state import current_intended_device
from .tensor import FakeTensor, describe

aten = torch.ops.aten

# Operators whose result is read from the data: fakes cannot answer them.
DATA_OPS = {
    aten._local_scalar_dense.default: "item()",
    aten.equal.default: "torch.equal()",
    aten.is_nonzero.default: "bool()",
}


class no_python_dispatch:
    """Run ATen kernels directly: no modes, no subclass handlers, no torch functions."""

    __slots__ = ("_guards",)

    def __enter__(self):
        self._guards = (torch._C._DisableTorchDispatch(), torch._C.DisableTorchFunction())
        for g in self._guards:
            g.__enter__()

    def __exit__(self, *exc):
        for g in reversed(self._guards):
            g.__exit__(*exc)


def meta_twin(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor with the geometry of real tensor ``t`` (no data is read)."""
    size, stride, offset = t.size(), t.stride(), t.storage_offset()
    extent = 0 if 0 in size else 1 + sum((n - 1) * s for n, s in zip(size, stride))
    with no_python_dispatch():
        storage = torch.empty(offset + extent, dtype=t.dtype, device=META)
        return storage.as_strided(size, stride, offset)


class Call:
    """What running one operator on fakes produced."""

    __slots__ = (
        "func",
        "flat",
        "spec",
        "out",
        "device",
        "mutated",
        "fresh",
        "out_flat",
    )

    def __init__(self, func, flat, spec, out, device, mutated, fresh, out_flat=()):
        self.func = func
        self.flat = flat  # flattened (args, kwargs) as given
        self.spec = spec
        self.out = out  # the result, fakes in place of meta tensors
        self.device = device  # device of new outputs
        self.mutated = mutated  # input fakes written in place (their geometry is synced)
        self.fresh = fresh  # (position in out_flat, new output fake)
        self.out_flat = out_flat  # the flattened result


def _mutated_positions(func) -> tuple[int, ...]:
    """Indices, in flattened argument order of a schema, of arguments written in place."""
    cached = _MUTATED.get(func)
    if cached is None:
        cached = tuple(
            i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write
        )
        _MUTATED[func] = cached
    return cached


_MUTATED: dict = {}


def run(func, args, kwargs, convert_real=None) -> Call:
    """Run ``func`` on the shadows of its fake arguments and wrap the outputs.

    ``convert_real(t)`` returns the meta stand-in of a real tensor argument;
    the default makes a meta twin.  The output device follows the rules in
    :mod:`fake.device`.  Outputs that are the meta shadow of an input (in-place
    ops) come back as that same input fake, with its geometry brought up to
    date (``t_()``, ``resize_()``, ``as_strided_()`` change it).
    """
    flat, spec = tree_flatten((args, kwargs))
    metas = list(flat)
    tensor_devices = []
    shadow_owner = {}
    for i, x in enumerate(flat):
        if isinstance(x, FakeTensor):
            shadow = x._shadow
            metas[i] = shadow
            shadow_owner[id(shadow)] = x
            tensor_devices.append((x.device, x.dim() == 0 and x.device.type == "cpu"))
        elif isinstance(x, torch.Tensor):
            if x.device.type != "meta":
                metas[i] = convert_real(x) if convert_real is not None else meta_twin(x)
            tensor_devices.append((x.device, x.dim() == 0 and x.device.type == "cpu"))
        elif isinstance(x, torch.device):
            metas[i] = META

    device = None
    explicit = kwargs.get("device") if kwargs else None
    if explicit is not None:
        device = normalize(explicit)
        if device.type == "meta":
            device = current_intended_device() or META
    if device is None:
        device = common_device(func._opname, tensor_devices) or CPU

    margs, mkwargs = tree_unflatten(metas, spec)
    try:
        with no_python_dispatch():
            result = func(*margs, **mkwargs)
    except NotImplementedError as e:
        raise NotImplementedError(
            f"{func} cannot run on fake tensors: it has no meta kernel, or its output "
            f"shape depends on the data ({str(e).splitlines()[0][:200]}). Run it on real "
            "tensors instead (materialize them first)."
        ) from None

    mutated: list = []
    fresh: list = []
    if device.type == "meta":
        # The caller asked for meta explicitly: meta it is, not fake.
        return Call(func, flat, spec, result, device, mutated, fresh)

    out_flat, out_spec = tree_flatten(result)
    for i, y in enumerate(out_flat):
        if isinstance(y, torch.Tensor):
            owner = shadow_owner.get(id(y))
            if owner is not None:
                _sync_geometry(owner)
                out_flat[i] = owner
                mutated.append(owner)
            else:
                fake = FakeTensor(y, device)
                out_flat[i] = fake
                fresh.append((i, fake))
    for fake in written_args(func, args, kwargs):
        if isinstance(fake, FakeTensor) and not any(fake is m for m in mutated):
            _sync_geometry(fake)
            mutated.append(fake)
    return Call(func, flat, spec, tree_unflatten(out_flat, out_spec), device, mutated, fresh, out_flat)


def _sync_geometry(fake: FakeTensor) -> None:
    """Make the wrapper report the geometry of its shadow after an in-place op."""
    shadow = fake._shadow
    if (
        fake.shape != shadow.shape
        or fake.stride() != shadow.stride()
        or fake.storage_offset() != shadow.storage_offset()
    ):
        replacement = FakeTensor(shadow, fake.device, fake.requires_grad)
        torch.Tensor.data.__set__(fake, replacement)


class FakeHandler:
    """Computes operations on plain fake tensors (no recording).

    ``dispatch`` is called by the fake modes and by ``FakeTensor`` itself;
    the recorder of ``deferinit`` subclasses this class.
    """

    def dispatch(self, func, args, kwargs, context):
        if func in DATA_OPS:
            fake = next(a for a in args if isinstance(a, FakeTensor))
            raise FakeDataAccessError(DATA_OPS[func], describe(fake))
        if _mutates_real(func, args, kwargs):
            return self.run_real(func, args, kwargs)
        return run(func, args, kwargs).out

    def run_real(self, func, args, kwargs):
        """An in-place op on real tensors only: it stays real."""
        flat, _ = tree_flatten((args, kwargs))
        if any(isinstance(x, FakeTensor) for x in flat):
            raise RuntimeError(
                f"{func} would write fake data into a real tensor. Make the destination "
                "fake too (create it inside the fake context), or compute on real tensors."
            )
        with no_python_dispatch():
            return func(*args, **kwargs)

    def lift(self, real: torch.Tensor, device) -> FakeTensor:
        """A fake standing for real tensor ``real`` moved to ``device``."""
        return FakeTensor(meta_twin(real), device)

    def data_access(self, operation, fake, compute):
        raise FakeDataAccessError(operation, describe(fake))

    def set_data(self, fake, new) -> None:
        """``fake.data = new``: the fake takes ``new``'s geometry and shadow."""
        if not isinstance(new, FakeTensor):
            raise TypeError(
                f"cannot assign a {type(new).__name__} to the .data of a fake tensor; "
                "assign another fake tensor"
            )
        adopt(fake, new)


def adopt(fake: FakeTensor, new: FakeTensor) -> None:
    """``fake.data = new`` for two fakes: ``fake`` now aliases ``new``."""
    torch.Tensor.data.__set__(fake, new)
    with no_python_dispatch():
        fake.__dict__["_shadow"] = new._shadow.detach()
    fake.__dict__["_device"] = new.device


def written_args(func, args, kwargs) -> list:
    """The tensors an operator writes in place (``Tensor(a!)`` in its schema)."""
    positions = _mutated_positions(func)
    if not positions:
        return []
    schema_args = func._schema.arguments
    written = []
    for pos in positions:
        arg = schema_args[pos]
        value = kwargs.get(arg.name) if (arg.kwarg_only or pos >= len(args)) else args[pos]
        if isinstance(value, torch.Tensor):
            written.append(value)
        elif isinstance(value, (list, tuple)):
            written.extend(v for v in value if isinstance(v, torch.Tensor))
    return written


def _mutates_real(func, args, kwargs) -> bool:
    return any(
        not isinstance(t, FakeTensor) and t.device.type != "meta" for t in written_args(func, args, kwargs)
    )


handlers.set_plain(FakeHandler())
