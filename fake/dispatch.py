"""Running operators on fake tensors: swap fakes for shadows, run the meta
kernel, wrap the meta outputs as fakes on the right device.

:func:`run` is the single place where that happens; :class:`FakeHandler`
puts it behind the small interface the modes and ``FakeTensor`` call, and
the recorder of ``deferinit`` extends that interface.
"""

from __future__ import annotations

import torch

from . import constants, handlers, metacache
from .calls import library_call
from .bypass import no_python_dispatch
from .checks import check_arguments
from .device import CPU, META, common_device, kind_of, normalize
from .extent import extent
from .errors import FakeDataAccessError, FakeIntoRealError, UnsupportedOperatorError
from .flat import flatten, flatten_output, unflatten, unflatten_output
from .opinfo import OpInfo, op_info
from .standin import LIMIT_BYTES as STANDIN_LIMIT_BYTES, data_dependent, refusal, run_on_standins, standin_bytes
from .state import backend_meant, current_intended_device
from .tensor import FakeTensor, describe

aten = torch.ops.aten

# Operators whose result is read from the data: fakes cannot answer them.
DATA_OPS = {
    aten._local_scalar_dense.default: "item()",
    aten.equal.default: "torch.equal()",
    aten.is_nonzero.default: "bool()",
}


def meta_twin(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor with the geometry of real tensor ``t`` (no data is read)."""
    size, stride, offset = t.size(), t.stride(), t.storage_offset()
    with no_python_dispatch():
        storage = torch.empty(extent(size, stride, offset), dtype=t.dtype, device=META)
        return storage.as_strided(size, stride, offset)


class Call:
    """What running one operator on fakes produced."""

    __slots__ = ("info", "flat", "spec", "out", "device", "mutated", "fresh", "out_flat")

    def __init__(self, info, flat, spec, out, device, mutated, fresh, out_flat):
        self.info = info  # the OpInfo of the operator
        self.flat = flat  # flattened (args, kwargs) as given
        self.spec = spec
        self.out = out  # the result, fakes in place of meta tensors
        self.device = device  # device of new outputs
        self.mutated = mutated  # fakes written in place (their geometry is synced)
        self.fresh = fresh  # (position in out_flat, new output fake)
        self.out_flat = out_flat  # the flattened result


def run(func, args, kwargs, info: OpInfo | None = None, convert_real=None) -> Call:
    """Run ``func`` on the shadows of its fake arguments and wrap the outputs.

    ``convert_real(t)`` returns the meta stand-in of a real tensor argument;
    the default makes a meta twin.  The output device follows the rules in
    :mod:`deferinit.fake.device`.  Outputs that are the meta shadow of an input (in-place
    ops) come back as that same input fake, with its geometry brought up to
    date (``t_()``, ``resize_()``, ``as_strided_()`` change it).
    """
    if info is None:
        info = op_info(func)
    if info.writes and not info.skip_meta:
        # Aliasing fakes may share one shadow; an in-place op that can
        # change a geometry (t_(), resize_()) must only change its own.
        with no_python_dispatch():
            for w in info.written(args, kwargs):
                if isinstance(w, FakeTensor):
                    w.__dict__["_shadow"] = w._shadow.detach()
    flat, spec = flatten(args, kwargs)
    metas = list(flat)
    tensor_devices = []
    shadow_owner = {}
    for i, x in enumerate(flat):
        if isinstance(x, torch.Tensor):
            if isinstance(x, FakeTensor):
                shadow = x._shadow
                metas[i] = shadow
                shadow_owner[id(shadow)] = x
                device = x.__dict__["_device"]
            else:
                device = x.device
                if kind_of(device) != "meta":
                    metas[i] = convert_real(x) if convert_real is not None else meta_twin(x)
            tensor_devices.append((device, kind_of(device) == "cpu" and x.dim() == 0))
        elif type(x) is torch.device:
            metas[i] = META

    device = None
    explicit = kwargs.get("device") if kwargs else None
    if explicit is not None:
        device = normalize(explicit)
        kind = kind_of(device)
        if kind == "meta":
            device = current_intended_device() or META
        elif kind == "cpu":
            device = _options_device(tensor_devices) or device
    if device is None:
        if len(tensor_devices) == 1:
            device = tensor_devices[0][0]
        else:
            device = common_device(info.opname, tensor_devices) or CPU

    margs, mkwargs = unflatten(metas, spec)
    is_meta = kind_of(device) == "meta"
    if not is_meta:
        # What eager kernels reject and meta kernels let through (deferinit.fake.checks).
        check_arguments(func, margs, mkwargs, info.written(margs, mkwargs) if info.writes else ())

    if info.skip_meta and isinstance(args[0], FakeTensor):
        # An in-place random fill: the result is the input, geometry unchanged.
        owner = args[0]
        return Call(info, flat, spec, owner, device, [owner], [], [owner])

    try:
        result = metacache.call(info, metas, spec, margs, mkwargs)
    except RuntimeError as e:  # NotImplementedError included
        if any(m in str(e) for m in _DATA_READ_ON_META):
            # A kernel that reads values (allclose calls item()): the caller
            # computes it from the data, or refuses as for item().
            fake = next((x for x in flat if isinstance(x, FakeTensor)), None)
            raise FakeDataAccessError(f"torch.{info.opname}()", describe(fake) if fake is not None else "") from None
        if not isinstance(e, NotImplementedError) and not data_dependent(func):
            raise
        result = _without_meta_kernel(func, margs, mkwargs, e)
    mutated: list = []
    fresh: list = []
    if is_meta:
        # The caller asked for meta explicitly: meta it is, not fake.
        return Call(info, flat, spec, result, device, mutated, fresh, [])

    out_flat, how = flatten_output(result)
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
    if info.writes:
        seen = {id(m) for m in mutated}  # a foreach op writes hundreds: no quadratic scan
        for fake in info.written(args, kwargs):
            if isinstance(fake, FakeTensor) and id(fake) not in seen:
                _sync_geometry(fake)
                mutated.append(fake)
                seen.add(id(fake))
    out = out_flat[0] if how is None else unflatten_output(out_flat, how)
    return Call(info, flat, spec, out, device, mutated, fresh, out_flat)


def _materialize_first() -> str:
    """The fix for a library call that met fakes of a deferred model."""
    call = library_call()
    if call is None:
        return ""
    function = call.split(" ")[0].rpartition(".")[2]
    return f" (fakes from a deferred model: materialize it first, materialize_module(model), then call {function})"


def _options_device(tensor_devices):
    """The device an explicit ``device=cpu`` means when C++ wrote it.

    Inside a torch function called on a fake whose C++ side sits on CPU (see
    ``deferinit.fake.mode._backend_stands_for``), C++ code that builds tensors with
    that fake's options asks for CPU and means the fake's device: a factory
    (SDPA's masks) or an operator on such fakes (``rms_norm``'s cast back).
    Python calls never get here with such a device (deferinit.fake.function rewrites
    them), and a real CPU tensor among the arguments means CPU.
    """
    meant = backend_meant()
    if meant is None:
        return None
    for device, is_cpu_scalar in tensor_devices:
        if device != meant and not is_cpu_scalar:
            return None
    return meant


# What meta kernels raise when they would read tensor values.
_DATA_READ_ON_META = ("cannot be called on meta tensors", "Cannot copy out of meta tensor")


def _without_meta_kernel(func, margs, mkwargs, error):
    """The meta result of ``func``, which has no meta kernel: from stand-ins
    (:mod:`deferinit.fake.standin`) where they can tell, else UnsupportedOperatorError."""
    reason = refusal(func)
    if reason is None:
        size = standin_bytes(margs, mkwargs)
        if size > STANDIN_LIMIT_BYTES:
            amount = f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size} bytes"
            reason = (
                f"its output geometry would be computed on {amount} of stand-ins "
                f"(limit DEFERINIT_STANDIN_LIMIT_BYTES={STANDIN_LIMIT_BYTES})"
            )
        else:
            try:
                return run_on_standins(func, margs, mkwargs)
            except NotImplementedError as e:
                reason, error = "no CPU kernel to compute its output geometry on stand-ins", e
    unsupported = UnsupportedOperatorError(
        f"{func} cannot run on fake tensors: it has no meta kernel, and {reason} "
        f"({_excerpt(str(error))}). Run it on real tensors instead (materialize them first)."
    )
    # A deferred caller can compute such an op from the values (see deferinit).
    unsupported.data_dependent = data_dependent(func)
    raise unsupported from None


def _excerpt(message: str, limit: int = 240) -> str:
    """The first line of PyTorch's message, cut at a word if it is long."""
    line = message.strip().splitlines()[0] if message.strip() else ""
    if len(line) <= limit:
        return line
    return line[:limit].rsplit(" ", 1)[0] + " ..."


def _sync_geometry(fake: FakeTensor) -> None:
    """Make the wrapper report the geometry of its shadow after an in-place op."""
    shadow = fake._shadow
    if (
        fake.shape != shadow.shape
        or fake.stride() != shadow.stride()
        or fake.storage_offset() != shadow.storage_offset()
    ):
        replacement = FakeTensor(shadow, fake.device, fake.requires_grad)
        with no_python_dispatch():  # set_data asks a (dispatched) compatibility question
            torch.Tensor.data.__set__(fake, replacement)


_LIFT_FRESH = aten.lift_fresh.default


def views_real(info: OpInfo, args, kwargs) -> bool:
    """Whether the op returns a view of a real (not fake, not meta) tensor.

    Such a view shares the real tensor's memory eagerly (``t[::2]``, the
    ``detach`` that ``numpy()`` and ``nn.Parameter`` call in C++), so it
    stays real: a fake could neither show the data nor carry writes to it.
    """
    if info.view_arg is None or info.func is _LIFT_FRESH:
        return False  # lift_fresh: torch.tensor(data) makes a new tensor
    base = info.arg(args, kwargs, info.view_arg)
    return isinstance(base, torch.Tensor) and not isinstance(base, FakeTensor) and base.device.type != "meta"


def writes_real(info: OpInfo, args, kwargs) -> bool:
    """Whether the op writes a real (not fake, not meta) tensor in place."""
    if not info.writes:
        return False
    for t in info.written(args, kwargs):
        if not isinstance(t, FakeTensor) and t.device.type != "meta":
            return True
    return False


class FakeHandler:
    """Computes operations on plain fake tensors (no recording).

    ``dispatch`` is called by the fake modes and by ``FakeTensor`` itself;
    the recorder of ``deferinit`` subclasses this class.
    """

    def dispatch(self, func, args, kwargs, context):
        info = op_info(func)
        name = DATA_OPS.get(func) or info.reads_data
        if name is not None:
            value = constants.read(func, args, kwargs, FakeTensor)
            if value is not NotImplemented:
                return value
            fake = next((a for a in flatten(args, kwargs)[0] if isinstance(a, FakeTensor)), None)
            if fake is None:  # torch.equal of real tensors: eager's answer
                with no_python_dispatch():
                    return func(*args, **kwargs)
            raise FakeDataAccessError(name, describe(fake))
        if writes_real(info, args, kwargs) or views_real(info, args, kwargs):
            return self.run_real(func, args, kwargs)
        call = run(func, args, kwargs, info)
        constants.after(call, func, FakeTensor)  # values kept where they are known
        return call.out

    def run_real(self, func, args, kwargs):
        """An in-place op on real tensors, or a view of one: it stays real."""
        flat, _ = flatten(args, kwargs)
        if any(isinstance(x, FakeTensor) for x in flat):
            raise FakeIntoRealError(
                f"{func} would write fake data into a real tensor{self.where()}. Make the "
                "destination fake too (create it inside the fake context), or compute on "
                f"real tensors{_materialize_first()}."
            )
        with no_python_dispatch():
            return func(*args, **kwargs)

    def where(self) -> str:
        """Where in the user's code the current operation runs, for messages:
        the library call it runs in, if any (see :mod:`deferinit.fake.calls`)."""
        call = library_call()
        return f" (inside {call})" if call is not None else ""

    def lift(self, real: torch.Tensor, device, like=None) -> FakeTensor:
        """A fake standing for real tensor ``real`` moved to ``device`` (made for ``like``)."""
        return FakeTensor(meta_twin(real), device)

    def data_access(self, operation, fake, compute):
        value = constants.value_of(fake)
        if value is None:
            raise FakeDataAccessError(operation, describe(fake))
        return compute(value)

    def address(self, fake, refusal) -> int:
        """``fake.data_ptr()``: a plain fake has no memory, hence no address;
        ``refusal()`` is the error that says so."""
        raise refusal()

    def requires_grad_changed(self, fake) -> None:
        """After ``requires_grad_`` on ``fake`` (the recorder notes it)."""

    def share_memory(self, fake) -> None:
        """``fake.share_memory_()``: a plain fake has no memory to share."""
        raise FakeDataAccessError(
            "share_memory_()", describe(fake),
            f"A fake tensor has no memory to share{self.where()}. Share real tensors "
            "(a deferred model's tensors are shared once materialized).",
        )

    def is_shared(self, fake) -> bool:
        """``fake.is_shared()``: a plain fake's memory is never shared."""
        return False

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
    with no_python_dispatch():
        torch.Tensor.data.__set__(fake, new)
        fake.__dict__["_shadow"] = new._shadow.detach()
    fake.__dict__["_device"] = new.device


handlers.set_plain(FakeHandler())
