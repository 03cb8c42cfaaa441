"""The recorder: computes operations on deferred fakes and appends them to the graph.

It extends the plain fake handler of :mod:`fake.dispatch`.  Every operator
that touches a recorded fake (or runs inside ``deferred_init``) becomes a
:class:`~deferinit.graph.Node`; its fresh outputs get a
:class:`~deferinit.graph.Value` on a new storage, or on their base's storage
for views; the tensors it writes move their storage's head to it.
"""

from __future__ import annotations

import torch

from fake import handlers
from fake.dispatch import DATA_OPS, FakeHandler, adopt, meta_twin, no_python_dispatch, run, written_args
from fake.tensor import FakeTensor, describe

from .errors import InferenceTensorInputError, MixedFakeError, RecordingError
from .graph import Input, Node, Storage, Value
from .rng import stream_key

aten = torch.ops.aten

LIFT_OPS = frozenset({aten.lift_fresh.default, aten.lift_fresh_copy.default})

_random_cache: dict = {}
_view_arg_cache: dict = {}


def is_random(func) -> bool:
    cached = _random_cache.get(func)
    if cached is None:
        cached = _random_cache[func] = torch.Tag.nondeterministic_seeded in func.tags
    return cached


def _viewed_arg(func):
    """Index of the schema argument a view op's outputs alias, or None."""
    cached = _view_arg_cache.get(func, False)
    if cached is False:
        cached = None
        if func.is_view:
            for i, a in enumerate(func._schema.arguments):
                if a.alias_info is not None and not a.alias_info.is_write:
                    cached = i
                    break
        _view_arg_cache[func] = cached
    return cached


def attach(fake: FakeTensor, record, value: Value, storage: Storage) -> FakeTensor:
    d = fake.__dict__
    d["_record"] = record
    d["_value"] = value
    d["_storage"] = storage
    return fake


def is_deferred_fake(t) -> bool:
    return isinstance(t, FakeTensor) and t._record is not None


def _current_default_dtype():
    dtype = torch.get_default_dtype()
    return None if dtype is torch.float32 else dtype


class Recorder(FakeHandler):
    """Handler for recorded fakes (registered with :mod:`fake.handlers`)."""

    # -- the graph --------------------------------------------------------------

    def dispatch(self, func, args, kwargs, context):
        if func in DATA_OPS:
            return self._data_op(func, args, kwargs)
        if func in LIFT_OPS and not isinstance(args[0], FakeTensor) and args[0].device.type != "meta":
            return self.constant(args[0], args[0].device)
        record = context if context is not None else _record_of(args, kwargs)
        if func.namespace == "aten" and _is_real_write(func, args, kwargs):
            return self.run_real(func, args, kwargs)

        call = run(func, args, kwargs)
        if call.device.type == "meta":
            return call.out

        flat = call.flat
        node_flat = list(flat)
        has_tensor = False
        for i, x in enumerate(flat):
            if isinstance(x, FakeTensor):
                has_tensor = True
                node_flat[i] = self._read(x, func, record)
            elif isinstance(x, torch.Tensor):
                has_tensor = True
                if x.device.type != "meta":
                    node_flat[i] = self.external(x, record, func)
        spec = call.spec
        if not has_tensor and kwargs.get("dtype") is None and _has_dtype_kwarg(func):
            # A factory: pin the dtype it got from the default dtype.
            out = call.out_flat[0] if call.out_flat else None
            if isinstance(out, torch.Tensor):
                from torch.utils._pytree import tree_flatten

                node_flat, spec = tree_flatten((args, dict(kwargs, dtype=out.dtype)))
        node = Node("op", func, node_flat, spec)
        node.default_dtype = _current_default_dtype()

        written = call.mutated
        if is_random(func):
            device = written[0].device if written else call.device
            record.add_random(node, stream_key(kwargs, device))
        if written:
            self._writes(node, func, args, kwargs, call, written, record)
        if call.fresh:
            viewed = _viewed_arg(func)
            base_storage = None
            if viewed is not None:
                base = _arg(func, args, kwargs, viewed)
                if isinstance(base, FakeTensor):
                    base_storage = base._storage
            for pos, fake in call.fresh:
                storage = base_storage if base_storage is not None else Storage()
                attach(fake, record, Value(node, pos, fake, storage), storage)
        return call.out

    def _read(self, fake: FakeTensor, func, record) -> Input:
        other = fake._record
        if other is None:
            raise MixedFakeError(
                f"{func} inside deferred_init got a fake tensor {describe(fake)} made by "
                "fake_mode, whose values are unknown, so the result could not be "
                f"materialized (while constructing {_where()}). Create that tensor inside "
                "deferred_init, or use a real tensor."
            )
        if other is not record and record is not None:
            record.parents.add(other)
        return Input(fake._value, fake._storage.head)

    def _writes(self, node, func, args, kwargs, call, written, record) -> None:
        is_set = func._opname == "set_"
        node.writes = tuple(i for i, x in enumerate(call.flat) if any(x is w for w in written))
        for fake in written:
            if not isinstance(fake, FakeTensor):
                continue
            if is_set:
                source = _arg(func, args, kwargs, 1) if len(func._schema.arguments) > 1 else None
                fake.__dict__["_storage"] = source._storage if isinstance(source, FakeTensor) else Storage()
            else:
                fake._storage.head = node
            if is_set or not fake._value.same_geometry(fake):
                # t_(), resize_(), as_strided_(), set_(): a new value, same object.
                node.reshapes = True
                pos = next((i for i, y in enumerate(call.out_flat) if y is fake), None)
                if pos is None:
                    raise RecordingError(
                        f"{func} changed the shape of a tensor it does not return; this cannot "
                        f"be recorded (while constructing {_where()})."
                    )
                fake.__dict__["_value"] = Value(node, pos, fake, fake._storage)

    def external(self, t: torch.Tensor, record, func=None) -> Input:
        """A read of a real tensor from outside, kept by reference with its version."""
        if t.is_inference():
            raise InferenceTensorInputError(
                f"{func or 'an operation'} inside deferred_init used an inference tensor "
                f"{describe(t)} from outside. Inference tensors have no version counter, so "
                "a later in-place change could not be detected and the replay could be "
                f"silently wrong (while constructing {_where()}). Pass t.clone() made "
                "outside torch.inference_mode() instead."
            )
        node = Node("external", None, payload=t)
        node.version = t._version
        storage = Storage()
        value = Value(node, 0, _GeometryOf(meta_twin(t), t.device), storage)
        return Input(value, None)

    def constant(self, real: torch.Tensor, device) -> FakeTensor:
        """A fake holding a copy of ``real`` (a constant of the record) on ``device``."""
        record = current_record()
        with no_python_dispatch():
            payload = real.detach().clone()
        node = Node("constant", torch.device(device) if not isinstance(device, torch.device) else device, payload=payload)
        fake = FakeTensor(meta_twin(payload), device)
        storage = Storage()
        return attach(fake, record, Value(node, 0, fake, storage), storage)

    def lift(self, real, device):
        return self.constant(real, device)

    def opaque(self, fn, tensor: FakeTensor, args: tuple, kwargs: dict) -> FakeTensor:
        """Record ``fn(tensor, *args, **kwargs)`` as one call that writes ``tensor``
        in place and may draw random numbers: replay re-runs ``fn`` itself.

        For Python initialisers whose control flow depends on the data they
        draw (``nn.init.trunc_normal_`` samples by rejection).
        """
        from torch.utils._pytree import tree_flatten

        record = tensor._record
        flat, spec = tree_flatten(((tensor, *args), kwargs))
        node_flat = [
            self._read(x, fn, record) if isinstance(x, FakeTensor)
            else self.external(x, record, fn) if isinstance(x, torch.Tensor)
            else x
            for x in flat
        ]
        node = Node("opaque", fn, node_flat, spec)
        node.default_dtype = _current_default_dtype()
        record.add_random(node, stream_key(kwargs, tensor.device))
        node.writes = (0,)
        tensor._storage.head = node
        return tensor

    # -- variable-level calls ---------------------------------------------------

    def set_data(self, fake, new) -> None:
        if not isinstance(new, torch.Tensor):
            raise TypeError(f"cannot assign a {type(new).__name__} to .data; assign a tensor")
        if not isinstance(new, FakeTensor):
            new = self._wrap_external(new, fake._record or current_record())
        elif new._record is None:
            raise MixedFakeError(
                f"tensor.data = {describe(new)}: the new data is a fake from fake_mode, whose "
                "values are unknown. Create it inside deferred_init, or assign a real tensor."
            )
        adopt(fake, new)
        attach(fake, new._record, new._value, new._storage)

    def _wrap_external(self, t: torch.Tensor, record) -> FakeTensor:
        read = self.external(t, record)
        fake = FakeTensor(meta_twin(t), t.device)
        return attach(fake, record, read.value, read.value.storage or Storage())

    # -- data -------------------------------------------------------------------

    def _data_op(self, func, args, kwargs):
        fakes = [a for a in args if isinstance(a, FakeTensor)]
        name = DATA_OPS[func]

        def compute(*reals):
            it = iter(reals)
            real_args = [next(it) if isinstance(a, FakeTensor) else a for a in args]
            with no_python_dispatch():
                return func(*real_args, **kwargs)

        return self.data_access(name, fakes, compute)

    def data_access(self, operation, fake, compute):
        from .evaluate import evaluate

        fakes = fake if isinstance(fake, list) else [fake]
        plain = [f for f in fakes if f._record is None]
        if plain:
            return super().data_access(operation, plain[0], compute)
        reals = evaluate(fakes, operation)
        return compute(*reals)


class _GeometryOf:
    """Geometry of a meta stand-in, reported on a given device (for Value)."""

    __slots__ = ("shape", "dtype", "device", "_t")

    def __init__(self, t, device):
        self._t = t
        self.shape = t.shape
        self.dtype = t.dtype
        self.device = device

    def stride(self):
        return self._t.stride()

    def storage_offset(self):
        return self._t.storage_offset()


def _arg(func, args, kwargs, index):
    a = func._schema.arguments[index]
    if index < len(args) and not a.kwarg_only:
        return args[index]
    return kwargs.get(a.name)


_dtype_kwarg_cache: dict = {}


def _has_dtype_kwarg(func) -> bool:
    cached = _dtype_kwarg_cache.get(func)
    if cached is None:
        cached = _dtype_kwarg_cache[func] = any(a.name == "dtype" for a in func._schema.arguments)
    return cached


def _is_real_write(func, args, kwargs) -> bool:
    for t in written_args(func, args, kwargs):
        if not isinstance(t, FakeTensor) and t.device.type != "meta":
            return True
    return False


def _record_of(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, FakeTensor) and a._record is not None:
            return a._record
        if isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, FakeTensor) and b._record is not None:
                    return b._record
    return current_record()


def _where() -> str:
    from .where import constructing

    return constructing()


def current_record():
    from .session import current_record as _current

    return _current()


RECORDER = Recorder()
handlers.register_deferred(RECORDER)
