"""Recording the calls every constructor makes, without a dispatcher round trip.

Building a Llama-70B-shaped model records about three calls per parameter:
a factory (``torch.empty``, ``zeros``, ``ones``), ``Tensor.detach`` (inside
``nn.Parameter``) and an in-place fill (``uniform_``/``normal_``/``fill_``/
``zero_`` from ``nn.init``, whose ``normal_``, ``uniform_``, ``constant_`` and
``kaiming_uniform_`` are taken here whole).  Through the dispatcher each costs two Python round trips and
a meta kernel (``normal_``'s is a Python decomposition costing hundreds of
microseconds).  At the function level, before any dispatch, the result is
fully known: these handlers build the very node the dispatch path would
record and the fake it would return.  Whenever a call is not the plain case
(an ``out=``, a tensor-valued fill, a leaf that requires grad under grad
mode, a dtype not yet checked by the meta kernel...) they return
``NotImplemented`` and the general path runs.  ``tests/deferinit`` checks
that both paths record the same graph.
"""

from __future__ import annotations

import math

import torch

from deferinit.fake.checks import check_fill
from deferinit.fake.device import kind_of, normalize
from deferinit.fake.flat import flatten
from deferinit.fake.function import default_device
from deferinit.fake.opinfo import op_info
from deferinit.fake.state import current_intended_device
from deferinit.fake.tensor import FakeTensor, make_fake

from .ir.graph import Input, Node, Storage, Value
from .random.rng import key_of_generator

aten = torch.ops.aten
_META = torch.device("meta")
_STRIDED = torch.strided
_EMPTY = aten.empty.memory_format
_SEQUENCES = (tuple, list, torch.Size)
_increment_version = torch._C._increment_version


def _sizes(args):
    if len(args) == 1 and type(args[0]) is not int:
        args = args[0]
        if type(args) not in _SEQUENCES:
            return None
    for n in args:
        if type(n) is not int:
            return None
    return list(args)


def _attach(fake, record, node, index, storage, device):
    d = fake.__dict__
    d["_record"] = record
    d["_value"] = Value(node, index, fake, storage, device)
    d["_storage"] = storage
    return fake


def _default_dtype_node(node):
    dtype = _get_default_dtype()
    if dtype is not _FLOAT32:
        node.default_dtype = dtype


_get_default_dtype = torch.get_default_dtype
_FLOAT32 = torch.float32


def _factory(op, keys):
    """``torch.empty/zeros/ones(*size, dtype=, device=, requires_grad=)``."""
    allowed = frozenset(keys)

    def factory(record, args, kwargs):
        device = dtype = None
        requires_grad = False
        if kwargs:
            if not allowed.issuperset(kwargs):
                return NotImplemented
            if kwargs.get("layout") not in (None, _STRIDED) or kwargs.get("pin_memory"):
                return NotImplemented
            if kwargs.get("memory_format") not in (None, _CONTIGUOUS):
                return NotImplemented
            device = kwargs.get("device")
            dtype = kwargs.get("dtype")
            requires_grad = bool(kwargs.get("requires_grad"))
        size = _sizes(args)
        if size is None:
            return NotImplemented
        if device is None:
            device = current_intended_device() or default_device()
        if type(device) is not torch.device or (device.index is None) != (kind_of(device) == "cpu"):
            device = normalize(device)
        if kind_of(device) == "meta":
            return NotImplemented
        if dtype is None:
            dtype = torch.get_default_dtype()
        elif type(dtype) is not _DTYPE:
            # The node holds what the dispatcher would get: PyTorch's parser
            # turns bool/int/float/complex into torch dtypes.
            dtype = _PYTHON_DTYPES.get(dtype)
            if dtype is None:
                return NotImplemented  # the general path raises eager's TypeError
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            shadow = torch.empty(size, dtype=dtype, device=_META)
        node = Node("op", op, [size, dtype, device, False], _FACTORY_SPEC)
        if dtype is not torch.float32:
            _default_dtype_node(node)
        fake = make_fake(shadow, device, requires_grad)
        return _attach(fake, record, node, 0, Storage(), device)

    return factory


_DTYPE = torch.dtype
# As PyTorch's argument parser maps them (bool, int64, float64, complex128).
_PYTHON_DTYPES = {t: torch._C._nn._parse_to(t)[1] for t in (bool, int, float, complex)}
_FACTORY_KEYS = ("dtype", "device", "requires_grad", "layout", "pin_memory")
_CONTIGUOUS = torch.contiguous_format
# The flattened form of op(size, dtype=, device=, pin_memory=), size a leaf.
_FACTORY_SPEC = flatten((None,), {"dtype": None, "device": None, "pin_memory": False})[1]


def detach(record, args, kwargs):
    """``fake.detach()``: another tensor with the same value, not requiring grad."""
    if kwargs or len(args) != 1:
        return NotImplemented
    self = args[0]
    if type(self) is not FakeTensor or self._record is None:
        return NotImplemented
    d = self.__dict__
    # Aliases may share a shadow: in-place ops that could change a
    # geometry give the fake its own shadow first (deferinit.fake.dispatch.run).
    fake = make_fake(d["_shadow"], d["_device"])
    f = fake.__dict__
    f["_record"] = d["_record"]
    f["_value"] = d["_value"]
    f["_storage"] = d["_storage"]
    if "_data_alias" in d:  # detach shares the version counter
        f["_data_alias"] = True
    return fake


def _fill(op):
    """An in-place fill ``self.op_(*scalars)`` that keeps the geometry of ``self``."""
    info = op_info(op)
    params = [a for a in op._schema.arguments[1:] if not a.kwarg_only]
    names = [a.name for a in params]
    defaults = [a.default_value for a in params]
    random = info.random
    specs: dict = {}

    def fill(record, args, kwargs):
        self = args[0]
        if type(self) is not FakeTensor:
            return NotImplemented
        d = self.__dict__
        record = d.get("_record")
        if record is None:
            return NotImplemented
        if self.requires_grad and torch.is_grad_enabled():
            return NotImplemented  # eager raises for a leaf; let it
        scalars = list(args[1:])
        generator = None
        if kwargs:
            for key, value in kwargs.items():
                if key == "generator":
                    generator = value
                elif key in names:
                    i = names.index(key)
                    if i < len(scalars):
                        return NotImplemented
                    scalars.extend(defaults[len(scalars) : i])
                    scalars.append(value)
                else:
                    return NotImplemented
        if len(scalars) > len(names):
            return NotImplemented
        for x in scalars:
            if type(x) is not float and type(x) is not int and type(x) is not bool:
                return NotImplemented
        shadow = d["_shadow"]
        # Eager's argument checks, which meta kernels skip (deferinit.fake.checks).
        check_fill(op, shadow, tuple(scalars), generator)
        shape = (len(scalars), generator is not None)
        spec = specs.get(shape)
        if spec is None:
            spec = specs[shape] = flatten((None, *scalars), {"generator": generator} if generator is not None else {})[1]
        storage = d["_storage"]
        if storage.real is not None:
            return NotImplemented  # the general path explains why this cannot be recorded
        flat = [Input(d["_value"], storage.head), *scalars]
        if generator is not None:
            flat.append(generator)
        node = Node("op", op, flat, spec)
        _default_dtype_node(node)
        node.writes = (0,)
        if "_data_alias" in d:
            node.own_autograd().data_writes = (0,)
        if random:
            record.add_random(node, key_of_generator(generator) if generator is not None else d["_device"], storage)
        storage.head = node
        _increment_version((self,))
        return self

    return fill


FAST = {
    torch.empty: _factory(_EMPTY, (*_FACTORY_KEYS, "memory_format")),
    torch.zeros: _factory(aten.zeros.default, _FACTORY_KEYS),
    torch.ones: _factory(aten.ones.default, _FACTORY_KEYS),
    torch.Tensor.detach: detach,
    torch.Tensor.uniform_: _fill(aten.uniform_.default),
    torch.Tensor.normal_: _fill(aten.normal_.default),
    torch.Tensor.fill_: _fill(aten.fill_.Scalar),
    torch.Tensor.zero_: _fill(aten.zero_.default),
}


def _init(method, names):
    """``nn.init.<name>(tensor, ...)``, whose body is ``tensor.<method>(...)`` under
    ``no_grad``: its torch-function prologue hands every argument over by
    keyword (``names``), the fill is recorded as that body would record it."""
    fill = FAST[method]
    with_generator = names[-1] == "generator"

    def init(record, args, kwargs):
        if args or tuple(kwargs) != names:
            return NotImplemented
        values = list(kwargs.values())
        generator = values.pop() if with_generator else None
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            return fill(record, tuple(values), {"generator": generator} if generator is not None else {})
        finally:
            torch._C._set_grad_enabled(grad)

    return init


# Their torch-function prologue costs a round trip through the function mode
# and a second call of the function: transformers' _init_weights runs one per
# parameter.  Keyed by function and by code: the function mode finds the
# body meant by the code of the prologue when the name it passes has been
# replaced (deferinit.fake.mode._prologue).
_uniform = _init(torch.Tensor.uniform_, ("tensor", "a", "b", "generator"))
for _function, _handler in (
    (torch.nn.init.normal_, _init(torch.Tensor.normal_, ("tensor", "mean", "std", "generator"))),
    (torch.nn.init.uniform_, _uniform),
    (torch.nn.init.constant_, _init(torch.Tensor.fill_, ("tensor", "val"))),
):
    FAST[_function] = FAST[_function.__code__] = _handler


def _kaiming_uniform(record, args, kwargs):
    """``nn.init.kaiming_uniform_`` (every ``nn.Linear`` and ``nn.Conv*`` runs it):
    the bound from PyTorch's own fan and gain helpers, then the uniform fill."""
    if args or tuple(kwargs) != ("tensor", "a", "mode", "nonlinearity", "generator"):
        return NotImplemented
    tensor = kwargs["tensor"]
    if type(tensor) is not FakeTensor or 0 in tensor.shape:
        return NotImplemented  # the body warns about zero elements from its own frame
    fan = torch.nn.init._calculate_correct_fan(tensor, kwargs["mode"])
    gain = torch.nn.init.calculate_gain(kwargs["nonlinearity"], kwargs["a"])
    std = gain / math.sqrt(fan)  # the body's arithmetic, in its order: bit for bit its bound
    bound = math.sqrt(3.0) * std
    # The body's own fill (tensor.uniform_ under no_grad), not whatever
    # torch.nn.init.uniform_ names now: transformers' guards replace it.
    return _uniform(record, (), {"tensor": tensor, "a": -bound, "b": bound, "generator": kwargs["generator"]})


FAST[torch.nn.init.kaiming_uniform_] = FAST[torch.nn.init.kaiming_uniform_.__code__] = _kaiming_uniform
