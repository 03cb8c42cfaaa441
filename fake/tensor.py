"""``FakeTensor``: a tensor with a device, a shape and no data.

A fake tensor is a wrapper subclass: the Python object reports the device it
pretends to live on (also ``cuda`` on a CPU-only build), its shape, dtype,
strides and ``requires_grad``, and owns no memory.  Beside it lives a meta
tensor of the same geometry, its *shadow*, on which every operator actually
runs (see :mod:`deferinit.fake.dispatch`); the shadow's storage, which knows its size
but holds no bytes, is the fake's storage (see :mod:`deferinit.fake.storage`).
"""

from __future__ import annotations

import sys
import weakref

import torch

from torch.utils._device import DeviceContext as _DeviceContext

from .alive import life as _life
from . import handlers
from .bypass import no_python_dispatch
from .copying import deepcopy_tensor
from .device import backend_device, kind_of, normalize
from .errors import FakeDataAccessError
from .storage import fake_set_, storage_of
from .function import call_on_device, needs_rewrite, tensor_cuda, tensor_to, tensor_type_as

# Attributes the toolkit keeps on a fake; everything else in ``__dict__`` is
# the user's (``_is_hf_initialized`` and the like) and survives materialization.
INTERNAL_ATTRS = frozenset(
    {"_shadow", "_device", "_record", "_value", "_storage", "_is_param", "_param_cls", "_leaf", "_data_alias", "_life"}
)

_PARAMETER_NEW = torch.nn.Parameter.__new__.__code__

_TYPED = "A typed storage is the tensor's memory (its bytes and address), and a fake has none."


def _no_memory(fake, what: str) -> str:
    """The hint for an access to a fake's memory (its address, a typed storage):
    what libraries want it for, and what to do, for a deferred fake (materialize)
    or a plain one (which has no values to give)."""
    if fake._record is not None:  # deferred: its values exist once materialized
        fix = ("Materialize it first (materialize_module(model), or materialize_tensor(t)), then save or read it")
    else:
        fix = "A fake from fake_mode has no values to save: build the tensor for real to save it"
    return (
        f"{what} Saving a tensor (safetensors' save_file, save_pretrained, torch.save) needs its bytes. {fix}. "
        "The size of its memory is untyped_storage().nbytes(), which a fake answers."
    )


class FakeTensor(torch.Tensor):
    """A tensor without data that reports a real device.

    Create fakes with :func:`deferinit.fake.fake_mode` (or ``deferinit.deferred_init``);
    the constructor is the low-level door: it takes the meta *shadow* and
    the device to report.  Called as code written for eager tensors calls
    a parameter's class, ``type(p)(data, requires_grad=...)`` or
    ``type(p)(p.to(device), **p.__dict__)`` (accelerate's
    ``init_empty_weights``, quantization libraries), it makes what
    ``p``'s eager class makes of ``data`` (see :func:`recreate`).

    Example::

        >>> t = FakeTensor(torch.empty(2, 3, device="meta"), "cuda")
        >>> t
        tensor(..., size=(2, 3), device='cuda:0', fake=True)
        >>> (t @ t.T).shape, (t @ t.T).device
        (torch.Size([2, 2]), device(type='cuda', index=0))
    """

    _shadow: torch.Tensor
    # Set by deferinit on fakes whose recipe is recorded.
    _record = None

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, shadow: torch.Tensor, device=None, requires_grad=None, **attrs):
        if device is None or attrs:
            return recreate(cls, shadow, requires_grad, attrs)
        requires_grad = bool(requires_grad)
        if not shadow.is_meta:
            raise ValueError(f"the shadow of a FakeTensor must be a meta tensor, got {shadow.device}")
        if type(device) is not torch.device or (device.index is None) != (kind_of(device) == "cpu"):
            device = normalize(device)
        return _make(cls, shadow, device, requires_grad)

    # The device is reported from Python.  The C++ object may sit on CPU
    # instead (see backend_device), so autograd never asks for a backend
    # that this build does not have.  A user's torch-function mode above a
    # fake mode sees these reads as it sees them of a real tensor (see
    # shown_to_modes).
    @property
    def device(self) -> torch.device:
        if _function_modes_on() and shown_to_modes():
            return _handle(_GETTERS["device"], (self,), self)
        return self.__dict__["_device"]

    @property
    def is_cuda(self) -> bool:
        if _function_modes_on() and shown_to_modes():
            return _handle(_GETTERS["is_cuda"], (self,), self)
        return kind_of(self.__dict__["_device"]) == "cuda"

    @property
    def is_cpu(self) -> bool:
        if _function_modes_on() and shown_to_modes():
            return _handle(_GETTERS["is_cpu"], (self,), self)
        return kind_of(self.__dict__["_device"]) == "cpu"

    @property
    def is_meta(self) -> bool:
        if _function_modes_on() and shown_to_modes():
            return _handle(_GETTERS["is_meta"], (self,), self)
        return False

    def get_device(self) -> int:
        if _function_modes_on() and shown_to_modes():
            return _handle(_GETTERS["get_device"], (self,), self)
        return reported(self, "get_device")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        for t in types:
            if t is not cls and dispatches_itself(t):
                # Beside a wrapper subclass of others (a quantized tensor, a
                # DTensor): it goes first and calls back with its inner tensors.
                return NotImplemented
        return handlers.for_args(args, kwargs).dispatch(func, args, kwargs or {}, None)

    # -- identity and printing -------------------------------------------------

    def __repr__(self, *, tensor_contents=None) -> str:
        parts = [f"size={tuple(self.shape)}", f"device='{self.device}'"]
        if self.dtype != torch.get_default_dtype():
            parts.append(f"dtype={self.dtype}")
        if self.requires_grad:
            parts.append("requires_grad=True")
        parts.append("fake=True")
        text = f"tensor(..., {', '.join(parts)})"
        if self.__dict__.get("_is_param"):
            text = "Parameter containing:\n" + text
        return text

    def __format__(self, spec: str) -> str:
        if not spec:
            return repr(self)
        return self._data_access(f"format(tensor, {spec!r})", lambda t: t.__format__(spec))

    def __setattr__(self, name, value) -> None:
        if name == "_is_param" and value:
            # nn.Parameter(custom_tensor) returns the custom tensor flagged
            # with _is_param; remember which Parameter class was asked for so
            # that materialization gives back an instance of it.  The stack is
            # read because no protocol serves: Parameter.__new__ passes the
            # class to nothing but its own frame (no torch function, no dispatch).
            caller = sys._getframe(1)
            if caller.f_code is _PARAMETER_NEW:
                cls = caller.f_locals.get("cls")
                if isinstance(cls, type):
                    self.__dict__["_param_cls"] = cls
        super().__setattr__(name, value)

    def __deepcopy__(self, memo):
        return deepcopy_tensor(self, memo, INTERNAL_ATTRS)

    # -- .data ------------------------------------------------------------------

    @property
    def data(self):
        out = torch.Tensor.data.__get__(self)
        # A version counter of its own: writes through it move no counter of
        # this tensor's views, as eagerly (the recorder keeps this apart).
        out.__dict__["_data_alias"] = True
        return out

    @data.setter
    def data(self, new) -> None:
        handlers.for_args((self, new), None).set_data(self, new)

    # -- nn.Parameter(fake) -------------------------------------------------------

    def detach(self):
        if type(self) is FakeTensor and sys._getframe(1).f_code is _PARAMETER_NEW:
            # nn.Parameter(t): eagerly _make_subclass, which no mode sees (it
            # neither calls torch functions nor dispatches an operator); the
            # custom-tensor path it takes for a fake must not show a user's
            # modes what eager construction never shows them.
            with _NO_TORCH_FUNCTION():
                return handlers.for_args((self,), None).dispatch(_DETACH_OP, (self,), {}, None)
        return _DETACH(self)

    # -- requires_grad ----------------------------------------------------------

    def requires_grad_(self, requires_grad=True):
        if type(self) is FakeTensor and sys._getframe(1).f_code is _PARAMETER_NEW:
            with _NO_TORCH_FUNCTION():  # see detach
                _REQUIRES_GRAD_(self, requires_grad)
        else:
            _REQUIRES_GRAD_(self, requires_grad)
        # A view follows its base's flag: the recorder notes when it changed.
        handlers.for_args((self,), None).requires_grad_changed(self)
        return self

    def _set_requires_grad(self, requires_grad) -> None:
        _REQUIRES_GRAD.__set__(self, requires_grad)
        handlers.for_args((self,), None).requires_grad_changed(self)

    requires_grad = property(torch._C.TensorBase.requires_grad.__get__, _set_requires_grad)

    # -- moving between devices ---------------------------------------------

    def to(self, *args, **kwargs):
        return tensor_to(self, args, kwargs, fake=True)

    def cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        return tensor_cuda(self, device, non_blocking, memory_format, fake=True)

    def cpu(self, memory_format=torch.preserve_format):
        return tensor_to(self, (), {"device": torch.device("cpu"), "memory_format": memory_format}, fake=True)

    def type_as(self, other):
        return tensor_type_as(self, other, fake=True)

    def set_(self, *args, **kwargs):
        return fake_set_(self, args, kwargs, INTERNAL_ATTRS)

    def new_empty(self, *args, **kwargs):
        return _new(torch.Tensor.new_empty, self, args, kwargs)

    def new_zeros(self, *args, **kwargs):
        return _new(torch.Tensor.new_zeros, self, args, kwargs)

    def new_ones(self, *args, **kwargs):
        return _new(torch.Tensor.new_ones, self, args, kwargs)

    def new_full(self, *args, **kwargs):
        return _new(torch.Tensor.new_full, self, args, kwargs)

    def new_empty_strided(self, *args, **kwargs):
        return _new(torch.Tensor.new_empty_strided, self, args, kwargs)

    def new_tensor(self, *args, **kwargs):
        return _new(torch.Tensor.new_tensor, self, args, kwargs)

    # -- data access ------------------------------------------------------------

    def _data_access(self, operation: str, compute):
        return handlers.for_args((self,), None).data_access(operation, self, compute)

    def tolist(self):
        return self._data_access("tolist()", lambda t: t.tolist())

    def __bool__(self):
        return self._data_access("bool()", lambda t: bool(t))

    def __int__(self):
        return self._data_access("int()", lambda t: int(t))

    def __float__(self):
        return self._data_access("float()", lambda t: float(t))

    def __index__(self):
        return self._data_access("operator.index()", lambda t: t.__index__())

    def numpy(self, *, force: bool = False):
        return self._data_access("numpy()", lambda t: _read_only(t.numpy(force=force), t))

    def __array__(self, dtype=None, copy=None):
        if copy:  # np.array(t): a copy of its own, writable as eagerly, in the order of t's strides
            return self._data_access("numpy.array()", lambda t: t.__array__(dtype).copy(order="K"))
        return self._data_access("numpy.asarray()", lambda t: _read_only(t.__array__(dtype), t))

    def data_ptr(self):
        # The handler decides: a deferred tensor may be given its real memory
        # (it becomes real, in place), a plain fake has none.
        handler = handlers.for_args((self,), None)

        def refusal():
            where = handler.where()
            error = FakeDataAccessError("data_ptr()", describe(self), _no_memory(self, f"A fake tensor has no memory, hence no address{where}."))
            return handlers.explain_data_access(error, self)

        return handler.address(self, refusal)

    def untyped_storage(self):
        # The shadow's meta storage, shared by every alias (see fake/storage.py).
        return storage_of(self.__dict__["_shadow"])

    def storage(self):
        raise handlers.explain_data_access(FakeDataAccessError("storage()", describe(self), _no_memory(self, _TYPED)), self)

    def _typed_storage(self):
        raise handlers.explain_data_access(FakeDataAccessError("storage()", describe(self), _no_memory(self, _TYPED)), self)

    # -- shared memory (model.share_memory()) ---------------------------------

    def share_memory_(self):
        # Eagerly the storage moves to shared memory; a deferred tensor's
        # storage is marked so that its real memory is shared once
        # materialized (the handler decides; plain fakes have none to share).
        handlers.for_args((self,), None).share_memory(self)
        return self

    def is_shared(self) -> bool:
        return handlers.for_args((self,), None).is_shared(self)

    def __dlpack__(self, *args, **kwargs):
        raise FakeDataAccessError("__dlpack__()", describe(self), "A fake tensor has no memory to share.")

    def __reduce_ex__(self, protocol):
        raise FakeDataAccessError(
            "pickling (torch.save, copy.copy)",
            describe(self),
            "Materialize the tensor first, or save its shape and dtype instead.",
        )


_DEFAULT_DISPATCH = torch.Tensor.__torch_dispatch__
_DISPATCHES_ITSELF: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def dispatches_itself(cls) -> bool:
    """Whether tensor class ``cls`` has a ``__torch_dispatch__`` of someone else's:
    not torch's default, and not a fake's (a wrapper subclass such as a
    quantized tensor or a DTensor, which handles its operators itself).

    Example::

        >>> from torch.testing._internal.two_tensor import TwoTensor
        >>> dispatches_itself(TwoTensor), dispatches_itself(torch.nn.Parameter), dispatches_itself(FakeTensor)
        (True, False, False)
    """
    known = _DISPATCHES_ITSELF.get(cls)
    if known is None:
        own = getattr(cls, "__torch_dispatch__", _DEFAULT_DISPATCH)
        known = own is not _DEFAULT_DISPATCH and not issubclass(cls, FakeTensor)
        _DISPATCHES_ITSELF[cls] = known
    return known


def _read_only(array, real: torch.Tensor):
    """The array of a value computed for a deferred tensor refuses writes where
    it shares that value's memory: eagerly they would change the tensor, here
    they could not reach its record (numpy raises "assignment destination is
    read-only").  A converted copy (``np.asarray(t, dtype=...)``) stays writable,
    as eagerly, where writes do not reach the tensor either."""
    storage = real.untyped_storage()
    start = storage.data_ptr()
    if start <= array.ctypes.data < start + max(storage.nbytes(), 1):
        array.flags.writeable = False
    return array


_make_wrapper = torch.Tensor._make_wrapper_subclass
_REQUIRES_GRAD = torch._C.TensorBase.requires_grad
_REQUIRES_GRAD_ = torch._C.TensorBase.requires_grad_
_DETACH = torch._C.TensorBase.detach
_DETACH_OP = torch.ops.aten.detach.default
_NO_TORCH_FUNCTION = torch._C.DisableTorchFunction
_STRIDED = torch.strided


def _make(cls, shadow, device, requires_grad=False):
    # Positional arguments: this runs for every fake ever made.
    self = _make_wrapper(
        cls, shadow.size(), shadow.stride(), shadow.storage_offset(), None,
        shadow.dtype, _STRIDED, backend_device(device), False, requires_grad,
    )
    d = self.__dict__
    d["_shadow"] = shadow
    d["_device"] = device
    # Holds torch.Tensor's .data and set_ patches while this fake lives (fake/alive.py).
    d["_life"] = _life()
    return self


def make_fake(shadow: torch.Tensor, device: torch.device, requires_grad: bool = False) -> "FakeTensor":
    """``FakeTensor(shadow, device)`` for a meta ``shadow`` and a normalized ``device`` (no checks)."""
    return _make(FakeTensor, shadow, device, requires_grad)


def recreate(cls, data, requires_grad=None, attrs=None):
    """``cls(data, **attrs)`` for a fake's class ``cls`` and ``__dict__`` ``attrs``:
    what the fake's eager class makes of ``data``.

    That class is the one remembered for materialization (``nn.Parameter``,
    or the class a fake subclass was made for); the fake's own attributes
    are dropped, the user's are passed on, as eagerly.  A call without a
    fake's ``__dict__`` (``type(p)(value, requires_grad=...)``, as accelerate's
    ``set_module_tensor_to_device`` makes) is taken for a parameter's, the
    one use of this idiom.

    Example::

        >>> with fake_mode():
        ...     p = torch.nn.Parameter(torch.ones(2))
        >>> q = type(p)(p.to("meta"), **p.__dict__)   # accelerate's init_empty_weights
        >>> type(q).__name__, q.device, q.requires_grad
        ('Parameter', device(type='meta'), True)
    """
    attrs = attrs or {}
    eager = attrs.get("_param_cls") or vars(cls).get("_fake_class_of")  # see fake.subclass
    if eager is None:
        if attrs.get("_is_param") or not attrs:
            eager = torch.nn.Parameter
        else:
            eager = torch.Tensor
    kwargs = {k: v for k, v in attrs.items() if k not in INTERNAL_ATTRS}
    if requires_grad is not None:
        kwargs["requires_grad"] = requires_grad
    return eager(data, **kwargs)


def _new(method, self, args, kwargs):
    """``self.new_*(..., device=d)`` without letting ``d`` reach the argument parser."""
    if method is torch.Tensor.new_tensor:
        return _new_tensor(self, *args, **kwargs)
    device = kwargs.get("device")
    if device is not None:
        device = normalize(device)
        if needs_rewrite(device):
            return call_on_device(method, (self, *args), kwargs, device)
    return method(self, *args, **kwargs)


def _new_tensor(self, data, dtype=None, device=None, requires_grad=False, layout=None, pin_memory=False):
    """``fake.new_tensor(data)``: a fake holding ``data`` (a constant of the record
    when ``self`` is deferred), on ``self``'s device unless told otherwise."""
    device = normalize(device) if device is not None else self.device
    dtype = dtype or (data.dtype if isinstance(data, torch.Tensor) else self.dtype)
    if isinstance(data, torch.Tensor) and is_fake(data):
        result = data.detach().clone().to(device=device, dtype=dtype)
    else:
        with no_python_dispatch():
            real = torch.tensor(data, dtype=dtype)
        result = handlers.for_args((self,), None).lift(real, device, self)
    if requires_grad:
        result.requires_grad_(True)
    return result


_shape = torch.Tensor.shape.__get__
_dtype = torch.Tensor.dtype.__get__
_device = torch.Tensor.device.__get__


_function_modes_on = torch._C._is_torch_function_mode_enabled
_handle = torch.overrides.handle_torch_function
_len_function = torch._C._len_torch_function_stack
_function_at = torch._C._get_function_stack_at

# What a fake reports from Python where a real tensor asks C++: the C
# getters a torch-function mode sees eagerly, by name.
_GETTERS = {
    "device": torch._C.TensorBase.device.__get__,
    "is_cuda": torch._C.TensorBase.is_cuda.__get__,
    "is_cpu": torch._C.TensorBase.is_cpu.__get__,
    "is_meta": torch._C.TensorBase.is_meta.__get__,
    "get_device": torch._C.TensorBase.get_device,
}
#: getter -> name, for the fake mode that answers them (deferinit.fake.mode).
REPORTED = {getter: name for name, getter in _GETTERS.items()}


def reported(fake: "FakeTensor", name: str):
    """What ``fake`` reports for ``name`` (a key of ``_GETTERS``), without asking any mode.

    Example::

        >>> t = FakeTensor(torch.empty(2, device="meta"), "cuda")
        >>> reported(t, "device"), reported(t, "is_cuda"), reported(t, "get_device")
        (device(type='cuda', index=0), True, 0)
    """
    device = fake.__dict__["_device"]
    if name == "device":
        return device
    kind = kind_of(device)
    if name == "get_device":
        return -1 if kind == "cpu" else device.index
    if name == "is_meta":
        return False
    return kind == name[3:]


def shown_to_modes() -> bool:
    """Whether a read of what a fake reports (its device) goes to the modes:
    a user's torch-function mode is on top of a fake mode, which answers it
    after them.  Eagerly such a mode sees the read of a real tensor's device;
    the fake mode below answers what the fake reports, not the device its
    C++ side sits on."""
    n = _len_function()
    if n == 0:
        return False
    top = _function_at(n - 1)
    if getattr(top, "answers_fakes", False) or type(top) is _DeviceContext:
        return False
    while n > 1:
        n -= 1
        if getattr(_function_at(n - 1), "answers_fakes", False):
            return True
    return False


def describe(t: torch.Tensor) -> str:
    """A short description of a tensor that never reads its data (nor asks a
    subclass that refuses to tell its shape, like ``UninitializedParameter``).
    A fake is described by the device it reports, never by the one its C++
    side sits on (CPU for ``cuda`` on a build without CUDA).

    Example::

        >>> describe(FakeTensor(torch.empty(2, 3, device="meta"), "cuda"))
        "(size=(2, 3), dtype=torch.float32, device='cuda:0')"
    """
    device = t.__dict__.get("_device") if isinstance(t, FakeTensor) else None
    if device is None:
        device = _device(t)
    return f"(size={tuple(_shape(t))}, dtype={_dtype(t)}, device='{device}')"


def is_fake(t) -> bool:
    """Whether ``t`` is a fake tensor (plain or deferred).

    Example::

        >>> with fake_mode():
        ...     t = torch.ones(2)
        >>> is_fake(t), is_fake(torch.ones(2))
        (True, False)
    """
    return isinstance(t, FakeTensor)


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """A detached meta tensor with the size, strides, offset and dtype of fake ``t``.

    Example::

        >>> with fake_mode():
        ...     t = torch.ones(2, 3).t()
        >>> m = meta_like(t)
        >>> m.device, m.shape, m.stride()
        (device(type='meta'), torch.Size([3, 2]), (1, 3))

    Raises ``ValueError`` for anything that is not a fake tensor.
    """
    if not isinstance(t, FakeTensor):
        raise ValueError(f"meta_like() expects a fake tensor, got {type(t).__name__}")
    with torch._C._DisableTorchDispatch(), torch._C.DisableTorchFunction():
        return t._shadow.detach()
