"""The recorder: computes operations on deferred fakes and appends them to the graph.

It extends the plain fake handler of :mod:`deferinit.fake.dispatch`.  Every operator
that touches a recorded fake (or runs inside ``deferred_init``) becomes a
:class:`~deferinit.ir.graph.Node`; its fresh outputs get a
:class:`~deferinit.ir.graph.Value` on a new storage, or on their base's storage
for views; the tensors it writes move their storage's head to it.
"""

from __future__ import annotations

import torch

from deferinit.fake import handlers
from deferinit.fake.locking import locked
from deferinit.fake.flat import flatten, flatten_output, unflatten, unflatten_output
from deferinit.fake.bypass import no_python_dispatch
from deferinit.fake.device import exists
from deferinit.fake.dispatch import DATA_OPS, FakeHandler, adopt, meta_twin, run, views_real, writes_real
from deferinit.fake.opinfo import op_info
from deferinit.fake.state import in_fake_mode
from deferinit.fake.errors import FakeDataAccessError, UnsupportedOperatorError
from deferinit.fake.tensor import FakeTensor, describe

from .collectives import NAMESPACES as COLLECTIVE_NAMESPACES, record_collective
from .errors import DataDependentError, InferenceTensorInputError, MixedFakeError, RecordingError
from .exclusive import exclusive
from .fastpath import FAST
from .outside import computes_plain, plain_data
from .random.realdraws import draw_real
from .plain import copied, dispatches_itself, holds_values
from .binding import attach, check_storage_not_real, is_deferred_fake  # noqa: F401 (re-exported)
from .grad import data_node, grad_fn_of, note_autograd, note_set_with_grad, note_writes, requires_grad_changed
from .ir.graph import Input, Node, Storage, Value
from .random.record import current_record
from .random.rng import stream_key
from .where import constructing, library_call

aten = torch.ops.aten

LIFT_OPS = frozenset({aten.lift_fresh.default, aten.lift_fresh_copy.default})
# Ops whose output is the input itself under another Python object (same
# storage, same geometry): the output shares the input's value, no node.
SAME_VALUE_OPS = frozenset({aten.detach.default, aten.alias.default})

class Recorder(FakeHandler):
    """Handler for recorded fakes (registered with :mod:`deferinit.fake.handlers`)."""

    # Function-level fast paths for the calls every constructor makes.
    fast = FAST

    # -- the graph --------------------------------------------------------------

    def dispatch(self, func, args, kwargs, context):
        if context is not None or current_record() is not None:
            return self._dispatch(func, args, kwargs, context, False)
        if func not in DATA_OPS and computes_plain(func, op_info(func), args, kwargs):
            # Running a deferred model, not changing it: see deferinit/outside.py.
            return FakeHandler.dispatch(self, func, args, kwargs, None)
        # A change to a finished deferral (or a value read from it): one at a
        # time with materializations (deferinit/exclusive.py).  One that made
        # these tensors real while this call waited leaves an operation on
        # real tensors: eager's, as if it had come after.
        deferred = [a for a in flatten(args, kwargs)[0] if isinstance(a, FakeTensor)]
        return locked(exclusive(), self._after, func, args, kwargs, deferred)

    def _after(self, func, args, kwargs, deferred):
        if any(not isinstance(a, FakeTensor) for a in deferred):
            return func(*args, **kwargs)
        return self._dispatch(func, args, kwargs, None, True)

    def _dispatch(self, func, args, kwargs, context, after):
        if func in DATA_OPS:
            return self._data_op(func, args, kwargs, DATA_OPS[func])
        info = op_info(func)
        if func in LIFT_OPS and not isinstance(args[0], FakeTensor) and args[0].device.type != "meta":
            return self.constant(args[0], args[0].device)
        if func.namespace in COLLECTIVE_NAMESPACES:  # c10d ops: see deferinit/collectives.py
            return record_collective(self, func, args, kwargs)
        if info.reads_data is not None:
            return self._data_op(func, args, kwargs, info.reads_data)
        if writes_real(info, args, kwargs) or views_real(info, args, kwargs):
            return self.run_real(func, args, kwargs)
        record = context if context is not None else _record_of(args, kwargs)

        try:
            call = run(func, args, kwargs, info)
        except UnsupportedOperatorError as e:
            if getattr(e, "data_dependent", False) and not info.writes:
                # nonzero, boolean masks: the shape is read from the values,
                # which are computed as for item().  (A write computed on
                # copies would not reach the tensor written: refused.)
                return self._data_op(func, args, kwargs, f"torch.{info.opname}()")
            raise UnsupportedOperatorError(f"{e}{self.where()}") from None
        except FakeDataAccessError as e:
            if info.writes:
                raise
            # Its kernel reads values (item() inside): computed like item().
            return self._data_op(func, args, kwargs, e.operation)
        if call.device.type == "meta":
            return call.out
        if func in SAME_VALUE_OPS and isinstance(args[0], FakeTensor) and args[0]._record is not None:
            source = args[0]
            if "_data_alias" in source.__dict__:  # shares its version counter
                call.out.__dict__["_data_alias"] = True
            return attach(call.out, source._record, source._value, source._storage)

        flat, spec = call.flat, call.spec
        if info.dtype_kwarg and kwargs.get("dtype") is None and call.fresh and not _has_tensor(flat):
            # A factory: pin the dtype it got from the default dtype.
            flat, spec = flatten(args, dict(kwargs, dtype=call.fresh[0][1].dtype))
        node_flat = list(flat)
        for i, x in enumerate(flat):
            if isinstance(x, torch.Tensor):
                if isinstance(x, FakeTensor):
                    node_flat[i] = self._read(x, func, record)
                elif x.device.type != "meta":
                    node_flat[i] = self.external(x, func)
            elif type(x) is torch.device:
                # The device meant, not the meta it was rewritten to.
                node_flat[i] = call.device
        node = Node("op", func, node_flat, spec)
        if after:
            node.after_deferral = True
        dtype = torch.get_default_dtype()
        if dtype is not torch.float32:
            node.default_dtype = dtype
        note_autograd(node, info, flat, args, kwargs)

        written = call.mutated
        for fake in written:
            if isinstance(fake, FakeTensor):
                check_storage_not_real(fake, func)
                if fake._record is not record and fake._record is not None and record is not None:
                    fake._record.parents.add(record)  # its recipe now runs through this record
        if written:
            self._writes(node, info, args, kwargs, call, written)
        if call.fresh:
            base_storage = None
            if info.view_arg is not None:
                base = info.arg(args, kwargs, info.view_arg)
                if isinstance(base, FakeTensor):
                    base_storage = base._storage
            data_alias = base_storage is not None and "_data_alias" in base.__dict__
            for pos, fake in call.fresh:
                storage = base_storage if base_storage is not None else Storage()
                d = fake.__dict__
                d["_record"] = record
                d["_value"] = Value(node, pos, fake, storage)
                d["_storage"] = storage
                if data_alias:  # a view shares its base's version counter
                    d["_data_alias"] = True
        if info.random:
            target = written[0] if written else call.fresh[0][1] if call.fresh else None
            device = target.device if target is not None else call.device
            storage = target.__dict__.get("_storage") if isinstance(target, FakeTensor) else None
            if not written and isinstance(target, FakeTensor):
                value = target._value
                node.filled = (value.size, tuple(value.stride), value.dtype)
            record.add_random(node, stream_key(kwargs, device), storage)
        return call.out

    def run_real(self, func, args, kwargs):
        info = op_info(func)
        record = current_record()
        if info.random and record is not None and not _has_fake(args, kwargs):
            # A random op on a real tensor while recording: eager's numbers now.
            return draw_real(self, record, func, args, kwargs, info)
        return FakeHandler.run_real(self, func, args, kwargs)

    def where(self) -> str:
        if current_record() is None:
            call = library_call()
            if call is None:
                return " (on a deferred tensor, after deferred_init returned)"
            function = call.split(" ")[0].rpartition(".")[2]
            return (
                f" (on a deferred tensor, after deferred_init returned, inside {call}; that call "
                f"needs the real model: materialize it first (materialize_module(model)), then call {function})"
            )
        return f" (while constructing {constructing()})"

    def _read(self, fake: FakeTensor, func, record) -> Input:
        other = fake._record
        if other is None:
            raise MixedFakeError(
                f"{func} {_in_or_after()} got a fake tensor {describe(fake)} made by "
                "fake_mode, whose values are unknown, so the result could not be "
                f"materialized{self.where()}. Create that tensor inside "
                "deferred_init, or use a real tensor."
            )
        if other is not record and record is not None:
            record.parents.add(other)
        return Input(fake._value, fake._storage.head)

    def _writes(self, node, info, args, kwargs, call, written) -> None:
        func = info.func
        is_set = info.opname == "set_"
        positions = []
        for i, x in enumerate(call.flat):
            for w in written:
                if x is w:
                    positions.append(i)
                    break
        node.writes = tuple(positions)
        note_writes(node, call.flat)
        for fake in written:
            if not isinstance(fake, FakeTensor):
                continue
            if is_set:
                if node.autograd.grad is not None:
                    note_set_with_grad(node, fake, positions[0])
                source = info.arg(args, kwargs, 1) if len(func._schema.arguments) > 1 else None
                fake.__dict__["_storage"] = source._storage if isinstance(source, FakeTensor) else Storage()
            else:
                fake._storage.head = node
            if is_set or (not info.skip_meta and not fake._value.same_geometry(fake)):
                # t_(), resize_(), as_strided_(), set_(): a new value, same object.
                node.reshapes = True
                pos = next((i for i, y in enumerate(call.out_flat) if y is fake), None)
                if pos is None:
                    raise RecordingError(
                        f"{func} changed the shape of a tensor it does not return; this cannot "
                        f"be recorded{self.where()}."
                    )
                fake.__dict__["_value"] = Value(node, pos, fake, fake._storage)

    def external(self, t: torch.Tensor, func=None) -> Input:
        """A read of a real tensor from outside, kept by reference with its version."""
        value, _ = self._external_value(t, func)
        return Input(value, None)

    def _external_value(self, t: torch.Tensor, func=None):
        if func is aten.copy_.default and (t.is_inference() or not holds_values(t)):
            # copy_ reads its source at the call, eagerly: read it now, where a
            # later change cannot be checked (no version counter) or replay
            # could not read it (its memory is not its values; see plain.py).
            t = copied(t)
        elif dispatches_itself(t):
            raise RecordingError(
                f"{func or 'an operation'} {_in_or_after()} used a {type(t).__name__} {describe(t)} from "
                f"outside, a tensor subclass with its own __torch_dispatch__{self.where()}: replay runs "
                "PyTorch's kernels on plain memory and cannot run that dispatch. Pass a plain tensor of its "
                "values (torch.empty(t.shape, dtype=t.dtype).copy_(t), or the library's own conversion)."
            )
        if t.is_inference():
            raise InferenceTensorInputError(
                f"{func or 'an operation'} {_in_or_after()} used an inference tensor "
                f"{describe(t)} from outside. Inference tensors have no version counter, so "
                "a later in-place change could not be detected and the replay could be "
                f"silently wrong{self.where()}. Pass t.clone() made "
                "outside torch.inference_mode() instead."
            )
        node = Node("external", None, payload=t)
        node.version = t._version
        try:
            node.memory = (t.untyped_storage(), t.dtype, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.is_conj(), t.is_neg())
        except (RuntimeError, NotImplementedError):
            pass  # no strided storage (a sparse tensor): read as it is
        storage = Storage()
        return Value(node, 0, meta_twin(t), storage, t.device), storage

    def constant(self, real: torch.Tensor, device, like: FakeTensor | None = None) -> FakeTensor:
        """A fake holding a copy of ``real`` (a constant of the record) on ``device``,
        in the record being recorded, else in that of ``like``."""
        record = current_record() or (like._record if like is not None else None)
        with no_python_dispatch():
            payload = real.detach().clone()
        node = Node("constant", torch.device(device) if not isinstance(device, torch.device) else device, payload=payload)
        fake = FakeTensor(meta_twin(payload), device)
        storage = Storage()
        return attach(fake, record, Value(node, 0, fake, storage), storage)

    lift = constant

    def opaque(self, fn, tensor: FakeTensor, args: tuple, kwargs: dict) -> FakeTensor:
        """Record ``fn(tensor, *args, **kwargs)`` as one call that writes ``tensor``
        in place and may draw random numbers: replay re-runs ``fn`` itself.

        For Python initialisers whose control flow depends on the data they
        draw (``nn.init.trunc_normal_`` samples by rejection).
        """
        record = _record_of((tensor,), {})
        flat, spec = flatten((tensor, *args), kwargs)
        node_flat = [
            self._read(x, fn, record) if isinstance(x, FakeTensor)
            else self.external(x, fn) if isinstance(x, torch.Tensor)
            else x
            for x in flat
        ]
        node = Node("opaque", fn, node_flat, spec)
        dtype = torch.get_default_dtype()
        if dtype is not torch.float32:
            node.default_dtype = dtype
        check_storage_not_real(tensor, fn)
        if tensor._record is not record and tensor._record is not None:
            tensor._record.parents.add(record)  # its recipe now runs through this record
        record.add_random(node, stream_key(kwargs, tensor.device), tensor._storage)
        node.writes = (0,)
        if "_data_alias" in tensor.__dict__:
            node.own_autograd().data_writes = (0,)
        tensor._storage.head = node
        return tensor

    # -- variable-level calls ---------------------------------------------------

    def requires_grad_changed(self, fake) -> None:
        if fake._record is not None:
            requires_grad_changed(fake)

    def set_data(self, fake, new) -> None:
        if not isinstance(new, torch.Tensor):
            raise TypeError(f"cannot assign a {type(new).__name__} to .data; assign a tensor")
        if not isinstance(new, FakeTensor):
            new = self._wrap_external(new, fake._record or current_record())
        elif new._record is None:
            if current_record() is None or in_fake_mode():
                raise MixedFakeError(plain_data(new, fake))  # says where such a fake comes from
            raise MixedFakeError(
                f"tensor.data = {describe(new)} on a deferred tensor {describe(fake)}: the new data "
                "is a fake from fake_mode, so its values are unknown and the deferred tensor would lose its "
                "recipe. Create the new data inside deferred_init, or assign a real tensor."
            )
        record = new._record
        node = None
        if fake._record is not None and grad_fn_of(fake) is not None:
            # It keeps its graph with other data: a node reads both.
            node = data_node(self._read(fake, "tensor.data =", record), self._read(new, "tensor.data =", record))
        adopt(fake, new)
        value = new._value if node is None else Value(node, 0, fake, new._storage)
        attach(fake, record, value, new._storage)

    def _wrap_external(self, t: torch.Tensor, record) -> FakeTensor:
        value, storage = self._external_value(t, "tensor.data =")
        return attach(FakeTensor(meta_twin(t), t.device), record, value, storage)

    # -- data -------------------------------------------------------------------

    def _data_op(self, func, args, kwargs, name):
        """An operator that reads values (``item()``, ``torch.allclose``), run on
        the current values of its deferred inputs; tensors it returns become
        constants of the record."""
        flat, spec = flatten(args, kwargs)
        fakes = [a for a in flat if isinstance(a, FakeTensor)]

        def compute(*reals):
            it = iter(reals)
            real_flat = [next(it) if isinstance(a, FakeTensor) else a for a in flat]
            a, k = unflatten(real_flat, spec)
            with no_python_dispatch():
                result = func(*a, **k)
            out, how = flatten_output(result)
            if not any(isinstance(y, torch.Tensor) for y in out):
                return result
            like = fakes[0] if fakes else None
            out = [self.constant(y, y.device, like) if isinstance(y, torch.Tensor) else y for y in out]
            return unflatten_output(out, how)

        return self.data_access(name, fakes, compute)

    def share_memory(self, fake) -> None:
        """``share_memory_()`` (``model.share_memory()``) on a deferred tensor: its
        storage is marked, and materialization moves its real memory to shared
        memory, as eager's call did (nothing is recorded: values do not change)."""
        if fake._record is None:
            return FakeHandler.share_memory(self, fake)
        storage = fake._storage
        if storage.real is not None:
            storage.real.share_memory_()
        else:
            storage.shared = True

    def is_shared(self, fake) -> bool:
        if fake._record is None:
            return FakeHandler.is_shared(self, fake)
        storage = fake._storage
        return storage.shared or (storage.real is not None and storage.real.is_shared())

    def address(self, fake, refusal) -> int:
        """``data_ptr()`` of a deferred tensor after construction: eagerly it has
        memory, and a library that asks for its address (accelerate's map of
        tied weights) goes on to use the tensor as real.  The tensor is
        materialized in place (``materialize_tensor``: eager's values, the
        generators untouched) and its real address returned.  While recording,
        on a device this process lacks, or before an interpreter is installed,
        ``refusal()`` is raised."""
        if fake._record is None or current_record() is not None or self.materialize is None:
            return FakeHandler.address(self, fake, refusal)
        if not exists(fake.device):
            return FakeHandler.address(self, fake, refusal)
        self.materialize(fake)
        return torch._C.TensorBase.data_ptr(fake)

    # Installed by the front door (deferinit/__init__.py): materialize_tensor.
    materialize = None

    def data_access(self, operation, fake, compute):
        fakes = fake if isinstance(fake, list) else [fake]
        plain = [f for f in fakes if f._record is None]
        if plain:
            return super().data_access(operation, plain[0], compute)
        reals = self.evaluate(fakes, operation)
        return compute(*reals)

    @staticmethod
    def generator_state(stream, k: int):
        """The exact state of ``stream``'s generator right before draw ``k``, by
        replaying the draws since the nearest known state (installed by the
        front door, like :meth:`evaluate`)."""
        raise DataDependentError(
            "the state of a generator while recording needs an interpreter, and none is "
            "installed (import deferinit, which installs materialize's)."
        )

    @staticmethod
    def evaluate(fakes, operation):
        """Real tensors with the current values of deferred ``fakes``.

        Computing values needs the interpreter, which lives in the layer
        above; the front door (``deferinit/__init__.py``) installs
        ``deferinit.materialize.evaluate.evaluate`` here.
        """
        raise DataDependentError(
            f"{operation} needs the value of a deferred tensor, and no interpreter is installed "
            "(import deferinit, which installs materialize's)."
        )


def _in_or_after() -> str:
    return "inside deferred_init" if current_record() is not None else "on a deferred tensor"


def _has_fake(args, kwargs) -> bool:
    return any(isinstance(x, FakeTensor) for x in flatten(args, kwargs)[0])


def _has_tensor(flat) -> bool:
    return any(isinstance(x, torch.Tensor) for x in flat)


def _record_of(args, kwargs):
    # Inside a deferral an op happens in its time (a draw in its streams), whoever made its inputs.
    current = current_record()
    if current is not None:
        return current
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, FakeTensor) and a._record is not None:
            return a._record
        if isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, FakeTensor) and b._record is not None:
                    return b._record
    return current_record()

RECORDER = Recorder()
handlers.register_deferred(RECORDER)
