"""``fake_mode``: every new tensor is fake while it is active.

A fake mode is a pair of PyTorch modes: a function mode, which sees Python
calls before their arguments are parsed (so ``device="cuda"`` can be
rewritten, see :mod:`deferinit.fake.function`), and a dispatch mode, which sees every
ATen operator and hands it to a handler.  Both live on PyTorch's per-thread
mode stacks, so a fake mode is thread-local and nests.

Both sink below the modes of others that are active when they are entered,
as PyTorch's own FakeTensorMode does: a user's mode, entered outside the
block or inside it, sees every call and operator first, as it would
eagerly, and what it returns is what the block gets (Lightning's
``init_module(empty_init=True)`` skips ``nn.init`` calls, a counting mode
counts eager's calls).  Only ``DeviceContext``, which must stay at the
bottom of the function stack, and PyTorch's infrastructure dispatch modes
stay below them.
"""

from __future__ import annotations

import gc
import sys
from types import FunctionType, GeneratorType

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import DeviceContext
from torch.utils._python_dispatch import TorchDispatchMode

from . import handlers
from .copying import deepcopy_tensor
from .cudnn import cudnn_as_on_cpu_builds
from .cudnn import release as release_cudnn
from .function import CONSTRUCTORS, rewrite_call, tensor_cuda, tensor_to, tensor_type_as
from .reads import READS, read, reads_memory
from .device import BACKENDLESS
from .state import backend_meant, backend_stands_for, planning
from .guard import Entry, undoing
from .subclass import accepting_fakes
from .tensor import REPORTED, FakeTensor, dispatches_itself, reported


# Calls a function past its own torch-function prologue (what
# torch.overrides.redispatch_function does, torch >= 2.8).
_skip_one_hop = getattr(torch._C, "_skip_one_hop_torch_function", None)
_push = torch._C._push_on_torch_function_stack
_pop = torch._C._pop_torch_function_stack
_len_function = torch._C._len_torch_function_stack
_function_at = torch._C._get_function_stack_at


_dispatch_depth = torch._C._len_torch_dispatch_stack
_parse_to = torch._C._nn._parse_to


# Calls that may need a device rewritten even without keyword arguments.
_HANDLED = CONSTRUCTORS | READS | set(REPORTED) | {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.type_as, torch.Tensor.__deepcopy__}


class FakeFunctionMode(TorchFunctionMode):
    """Rewrites devices in calls so that they never initialise a backend."""

    # Reads of a fake's device that a user's mode above saw come here to be
    # answered (deferinit.fake.tensor.shown_to_modes).
    answers_fakes = True

    def __init__(self, fake_cuda: bool, fast=None, context=None) -> None:
        super().__init__()
        self.fake_cuda = fake_cuda
        # func -> handler(context, args, kwargs) that may answer a call
        # without dispatching it (NotImplemented: take the general path).
        self.fast = fast or {}
        self.context = context
        # Fast paths stand in for the dispatch mode entered with this one, so
        # they only apply while it is the innermost dispatch mode (a fake_mode
        # inside deferred_init makes plain fakes; a user's mode above ours
        # sees every op): while the dispatch stack has the depth it had when
        # that mode was entered on top (-1: it went below a user's mode).
        self.partner_depth = -1
        # (function, first argument) of the Python bodies running through this mode.
        self.bodies: list = []
        self.closed = False  # its block ended (see __torch_function__)

    def __enter__(self):
        super().__enter__()
        _sink(self, _FUNCTION, _function_stays_below)
        return self

    def __exit__(self, *exc):
        _surface(self, _FUNCTION)
        # Popped already: an interrupt inside torch's own _pop_mode_temporarily
        # (torch.overrides) lost it; the guard of the block puts the stack back
        # (deferinit.fake.guard), and popping now would pop someone else's.
        if any(_function_at(i) is self for i in range(_len_function())):
            return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.closed:
            # Its block has ended, yet torch pushed it back: an interrupt inside
            # torch's own _pop_mode_temporarily (a contextlib generator) leaves
            # that generator suspended, and collecting it pushes the mode again.
            # Inert: every call runs as if the mode were not there.
            return func(*args, **(kwargs or {}))
        if func in _PLAIN:
            return func(*args, **kwargs) if kwargs else func(*args)
        meant = _backend_stands_for(args) if BACKENDLESS and type(func) not in _OPERATORS else None
        if meant is not None:
            with backend_stands_for(meant):
                return self.__torch_function__(func, types, args, kwargs)
        fast = self.fast.get(func)
        prologue = _UNSEEN
        if fast is None and not args and kwargs and type(func) is FunctionType:
            prologue = _prologue()
            fast = self.fast.get(prologue.f_code) if prologue is not None else None
        if fast is not None and _dispatch_depth() == self.partner_depth:
            result = fast(self.context, args, kwargs or {})
            if result is not NotImplemented:
                return result
        elif not kwargs and func not in _HANDLED and type(func) is not FunctionType:
            # Most calls (dim(), size(), add()...): nothing to rewrite.
            return func(*args)
        kwargs = kwargs or {}
        name = REPORTED.get(func)
        if name is not None and isinstance(args[0], FakeTensor):
            return reported(args[0], name)
        if func is _parse_to:
            # nn.Module.to parses its arguments: a device is only read there.
            return func(*args, **kwargs)
        if func is torch.Tensor.__deepcopy__:
            # A real tensor deep-copied under a fake mode (a template module
            # inside deferred_init): its copy is fake, laid out as eager's.
            return deepcopy_tensor(args[0], args[1])
        if type(func) is FunctionType and _skip_one_hop is not None:
            original = getattr(func, "__deferinit_stands_for__", None)
            if original is not None:
                # A diversion standing for a builtin (deferinit.random.pending): the
                # builtin is what is meant, fast paths included.
                return self.__torch_function__(original, types, args, kwargs)
            # A Python function with a torch-function prologue (nn.init.*,
            # F.*, Tensor.backward): run its body with this mode still
            # active, so that the calls inside it are seen here too (devices,
            # fast paths).
            if not args and kwargs:
                # The prologue passes the name it finds in its module: a
                # wrapper put there (transformers' guards, a library's
                # patch) already ran and called the function meant, whose
                # body runs here -- not the wrapper a second time.
                func = _meant(func, kwargs, _prologue() if prologue is _UNSEEN else prologue)
            key = (func, id(args[0]) if args else None)
            if key in self.bodies:
                # A Python Tensor method (Tensor.unflatten) calling its C
                # method through super(), which reports the same function:
                # the C method is what is meant.
                return getattr(torch._C.TensorBase, func.__name__)(*args, **kwargs)
            _push(self)
            self.bodies.append(key)
            try:
                return _skip_one_hop(func, types, args, kwargs)
            finally:
                self.bodies.pop()
                _pop()
        if func is torch.Tensor.to:
            return tensor_to(args[0], args[1:], kwargs, self.fake_cuda, fake=isinstance(args[0], FakeTensor))
        if func is torch.Tensor.cuda:
            return tensor_cuda(*args, **kwargs, fake_cuda=self.fake_cuda, fake=isinstance(args[0], FakeTensor))
        if func is torch.Tensor.type_as:
            return tensor_type_as(args[0], args[1], self.fake_cuda, fake=isinstance(args[0], FakeTensor))
        if func in READS and reads_memory(func, args, kwargs):
            # A file, a storage or a buffer: real, as eagerly (fake/reads.py).
            return read(func, args, kwargs, self.fake_cuda)
        return rewrite_call(func, args, kwargs, self.fake_cuda)


_HANDLE = torch.overrides.handle_torch_function.__code__


def _prologue():
    """The frame of the function whose torch-function prologue handed this call
    over, or None.

    The prologue (``nn.init.normal_``'s ``has_torch_function`` check) passes
    the function by the name it finds in its module, which a library may
    have replaced (transformers swaps ``torch.nn.init``'s functions for
    guards while it initializes weights); the body meant is the caller's.
    Frames: this one, ``__torch_function__``, ``handle_torch_function``, the
    prologue.  No protocol serves: ``handle_torch_function`` hands modes the
    object the prologue named, and only the prologue's frame holds the code
    that is running.
    """
    frame = sys._getframe(2)
    return frame.f_back if frame.f_code is _HANDLE else None


_UNSEEN = object()
_MEANT: dict = {}


def _meant(func, kwargs, caller):
    """The function whose prologue (frame ``caller``, see :func:`_prologue`) handed
    ``func``'s call over: ``func`` itself, or the function of the caller's code
    where ``func`` is a wrapper put in its name."""
    if caller is None:
        return func
    code = caller.f_code
    if code is func.__code__ or code.co_freevars:
        return func
    if not kwargs.keys() >= set(code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]):
        return func  # a body that needs its defaults: the function object is not at hand
    meant = _MEANT.get(code)
    if meant is None or meant.__globals__ is not caller.f_globals:
        meant = _MEANT[code] = FunctionType(code, caller.f_globals, code.co_name)
    return meant


# The calls every constructor makes most often (nn.init's no_grad blocks,
# register_parameter's grad_fn test, fan computations), which make no tensor
# and take no device: straight through.
_PLAIN = frozenset({
    torch._C._set_grad_enabled,
    torch.Tensor.grad_fn.__get__,
    torch.Tensor.dim,
    torch.Tensor.size,
})


# Operators called directly (DTensor running its local computation): their
# explicit devices are the caller's, never C++ options.
_OPERATORS = (torch._ops.OpOverload, torch._ops.OpOverloadPacket)


def _backend_stands_for(args):
    """The device of the fake ``args`` start with when its C++ side is on CPU.

    C++ composites build temporaries with the options of their first tensor
    (``rms_norm`` casting back to bf16, the masks of SDPA's fallback), whose
    C++ device is CPU where this build lacks the fake's backend (see
    ``deferinit.fake.device.backend_device``): inside such a call, those CPU devices
    mean the fake's (``deferinit.fake.dispatch``).
    """
    if not args:
        return None
    first = args[0]
    if type(first) in (list, tuple) and first:
        first = first[0]
    if not isinstance(first, FakeTensor):
        return None
    device = first.__dict__["_device"]
    if device not in BACKENDLESS or backend_meant() == device:
        return None
    return device


class FakeDispatchMode(TorchDispatchMode):
    """Hands every operator to a handler: the plain fake handler, or the
    recorder of ``deferinit`` (``context`` is then its record).

    It stays below the other dispatch modes that are active when it is
    entered, as PyTorch's own FakeTensorMode does: a ``MemTracker``, a
    ``FlopCounterMode`` or a user's logging mode sees every operator
    whichever of the two blocks is the outer one.  The mode of
    :func:`fake_mode` (``yields=True``) also lets tensor subclasses of
    others (DTensor) handle their operators first.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # No torch.compile ever runs inside the handler; skip the wrapper
        # that would cost a frame on every operator.
        return False

    def __init__(self, handler, context=None, yields: bool = False) -> None:
        super().__init__()
        self.handler = handler
        self.context = context
        self.yields = yields

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in types:
            if t is not torch.Tensor and dispatches_itself(t):
                # A wrapper subclass of others (DTensor, a quantized tensor)
                # handles its operators first and calls back with its inner
                # tensors, as under PyTorch's own FakeTensorMode.
                return NotImplemented
        kwargs = kwargs or {}
        handler = handlers.for_args(args, kwargs)
        if handler is handlers.plain():
            handler = self.handler
        return handler.dispatch(func, args, kwargs, self.context)

    def __enter__(self):
        super().__enter__()
        _sink(self, _DISPATCH, _dispatch_stays_below)
        return self

    def __exit__(self, *exc):
        _surface(self, _DISPATCH)
        if any(_DISPATCH.at(i) is self for i in range(_DISPATCH.length())):
            return super().__exit__(*exc)
        # Popped already (an interrupt in torch's own handler): as for FakeFunctionMode.


class _Stack:
    """One of PyTorch's per-thread mode stacks, as the few calls that reorder it."""

    __slots__ = ("length", "at", "push", "pop")

    def __init__(self, length, at, push, pop) -> None:
        self.length, self.at, self.push, self.pop = length, at, push, pop


_DISPATCH = _Stack(
    torch._C._len_torch_dispatch_stack, torch._C._get_dispatch_stack_at,
    torch._C._push_on_torch_dispatch_stack, lambda: torch._C._pop_torch_dispatch_stack(None),
)
_FUNCTION = _Stack(torch._C._len_torch_function_stack, torch._C._get_function_stack_at, _push, _pop)
_dispatch_at = _DISPATCH.at


def _dispatch_stays_below(mode) -> bool:
    # PyTorch's infrastructure modes (FakeTensorMode...) stay at the bottom.
    return isinstance(mode, FakeDispatchMode) or mode.is_infra_mode()


def _function_stays_below(mode) -> bool:
    # DeviceContext asserts it is at the bottom of the stack when it leaves.
    return isinstance(mode, (FakeFunctionMode, DeviceContext))


def _sink(mode, stack: _Stack, stays_below) -> None:
    """Move ``mode`` (on top of ``stack``) below the modes of others above our own,
    so that they see every call first, as they would without us."""
    above = []
    n = stack.length() - 1
    while n > 0:
        below = stack.at(n - 1)
        if stays_below(below):
            break
        above.append(below)
        n -= 1
    if not above:
        return
    stack.pop()
    for _ in above:
        stack.pop()
    stack.push(mode)
    for other in reversed(above):
        stack.push(other)


def _surface(mode, stack: _Stack) -> None:
    """Bring ``mode`` back to the top of ``stack``, so that leaving it pops it."""
    above = []
    n = stack.length()
    while n > 0 and stack.at(n - 1) is not mode:
        above.append(stack.at(n - 1))
        n -= 1
    if not above or n == 0:
        return  # on top already, or not on the stack at all
    for _ in above:
        stack.pop()
    stack.pop()
    for other in reversed(above):
        stack.push(other)
    stack.push(mode)


Entry.OURS = (FakeFunctionMode, FakeDispatchMode)


def fake_modes(handler, context=None, fake_cuda: bool = True, yields: bool = False) -> "FakeModes":
    """Enter a function mode and a dispatch mode for ``handler`` (internal; see :class:`FakeModes`)."""
    return FakeModes(handler, context, fake_cuda, yields)


class FakeModes:
    """A function mode and a dispatch mode for ``handler``, entered for a block.

    However the block ends, and wherever an interrupt arrives (also inside
    the modes' own enter and exit), the thread's mode stacks are left as they
    were, the user's own modes pushed in the block apart (see
    :mod:`deferinit.fake.guard`): a class whose exit runs three times over,
    each on one line and the later ones finishing what an interrupt stopped,
    not a generator a suspended ``with`` would leave for the collector."""

    __slots__ = ("handler", "context", "fake_cuda", "yields", "entry", "function_mode", "entered", "done")

    def __init__(self, handler, context=None, fake_cuda: bool = True, yields: bool = False) -> None:
        self.handler, self.context, self.fake_cuda, self.yields = handler, context, fake_cuda, yields
        self.entry = self.function_mode = None
        self.entered: list = []
        self.done = False

    def __enter__(self) -> None:
        self.entry = Entry()
        undoing(self._failed, self._enter)

    def _enter(self) -> None:
        function_mode = self.function_mode = FakeFunctionMode(self.fake_cuda, getattr(self.handler, "fast", None), self.context)
        dispatch_mode = FakeDispatchMode(self.handler, self.context, self.yields)
        for cm in (accepting_fakes(self.entry), cudnn_as_on_cpu_builds(self.fake_cuda, self.entry), function_mode, dispatch_mode):
            cm.__enter__()
            self.entered.append(cm)
        # Fast paths stand in for the dispatch mode only while no user's
        # dispatch mode sits above it (it sank below those entered before).
        depth = _dispatch_depth()
        if _dispatch_at(depth - 1) is dispatch_mode:
            function_mode.partner_depth = depth

    def __exit__(self, kind, value, tb) -> None:
        # No bare ``try:`` line first: Python reports a line there, outside the block.
        try: self.exit(kind is not None)  # noqa: E701 - one line each: see deferinit.fake.guard
        finally:
            try: self.exit(True)  # noqa: E701
            finally: self.exit(True)  # noqa: E701

    def exit(self, failed: bool) -> None:
        """Leave the block (idempotent): as it ended, or, ``failed``, putting the
        thread back as at the entry."""
        if self.done or self.entry is None:
            return
        if failed:
            self._failed()
        else:
            for cm in reversed(self.entered):
                cm.__exit__(None, None, None)
            if self.function_mode is not None:
                self.function_mode.closed = True
            self.entry.leave()
        self.done = True

    def _failed(self) -> None:
        if self.function_mode is not None:
            self.function_mode.closed = True
            _close_suspended_pops(self.function_mode)
        release_cudnn(self.entry)
        self.entry.restore()


# torch's own mode pops around a mode's Python-level call (handle_torch_function,
# HigherOrderOperator dispatch): contextlib generators that push the mode back
# in their ``finally``.
_POPS = tuple(
    getattr(getattr(fn, "__wrapped__", None), "__code__", None)
    for fn in (getattr(torch.overrides, "_pop_mode_temporarily", None),
               getattr(torch.utils._python_dispatch, "_pop_mode_temporarily", None))
)


def _close_suspended_pops(mode) -> None:
    """Close now torch's suspended ``_pop_mode_temporarily`` generators holding
    ``mode``: an interrupt inside contextlib's ``__exit__`` before it resumed
    one leaves it suspended, and the collector closing it later would push
    the (closed) mode back on the user's stack, after the guard put the stack
    right.  Closed here, the push happens before the guard does.  Only on the
    interrupted path: the collector's list of referrers is a walk over every
    object."""
    for ref in gc.get_referrers(mode):
        if type(ref) is GeneratorType and ref.gi_code in _POPS and ref.gi_suspended:
            try:
                ref.close()
            except Exception:  # noqa: BLE001 - torch's push failing leaves the stack for the guard
                pass


class fake_mode:
    """Context manager under which every new tensor is a :class:`FakeTensor`.

    Tensors made inside report their real device, shape, dtype and strides
    but own no memory; they stay fake after the block ends.  With
    ``fake_cuda=True`` CUDA tensors can be made on a build without CUDA;
    without it such a request fails as PyTorch fails.  Nested blocks work and
    the mode is per thread.

    Inside the block, tensors of a deferred model (``deferinit``) compute on
    their shadows like any fake, and their record is left as it is: a
    training step planned here changes nothing that materialization will
    produce.  Other dispatch modes (``MemTracker``, ``FlopCounterMode``)
    see every operator, whether they are entered inside or outside the
    block.  Tensors made from Python numbers, shapes and ``arange`` keep
    their values (see :mod:`deferinit.fake.constants`), so optimizers can step and
    checks on position ids get eager's answer.

    Example::

        >>> with fake_mode(fake_cuda=True):
        ...     layer = torch.nn.Linear(4096, 4096, device="cuda")
        >>> layer.weight
        Parameter containing:
        tensor(..., size=(4096, 4096), device='cuda:0', requires_grad=True, fake=True)
    """

    __slots__ = ("modes", "planning")

    def __init__(self, *, fake_cuda: bool = False) -> None:
        self.modes = FakeModes(handlers.plain(), None, fake_cuda, yields=True)
        self.planning = planning()

    def __enter__(self) -> None:
        # One line: an interrupt at a later line of __enter__ would leave the
        # modes pushed, and the with statement calls no __exit__ then.
        undoing(lambda: self.modes.exit(True), self._enter)

    def _enter(self) -> None:
        # planning()'s count is a stack the modes' entry puts back (deferinit.fake.state).
        self.modes.__enter__()
        self.planning.__enter__()

    def __exit__(self, kind, value, tb) -> None:
        # No bare ``try:`` line first: Python reports a line there, outside the block.
        try: self._exit(kind is not None)  # noqa: E701 - one line each: see deferinit.fake.guard
        finally:
            try: self._exit(True)  # noqa: E701
            finally: self._exit(True)  # noqa: E701

    def _exit(self, failed: bool) -> None:
        if not failed and not self.modes.done:
            self.planning.__exit__(None, None, None)
        self.modes.exit(failed)

