"""What ``torch.compile`` does with this toolkit's own code: runs it as written.

Dynamo evaluates every Python frame started while a compiled function runs,
and compiles those outside PyTorch's own files.  A fake reaches Python code
of ours from C++ (``__torch_dispatch__``), from methods and properties of
``FakeTensor`` and ``FakeStorage``, and through the functions patched onto
``torch.Tensor``; dynamo compiling them would trace the recorder itself (and
fails on the stack walks of :mod:`deferinit.where`).  So the code objects of
our packages are marked, once at import, to be skipped with everything they
call, through ``torch._C._dynamo`` (no import of ``torch._dynamo``, which is
slow), and their functions carry the flag ``torch.compiler.disable`` sets,
so that dynamo does not inline them into a graph either.  A compiled model
that is still deferred then runs as the plain call does: its operators on
fakes break dynamo's graph and run eagerly, here.
"""

from __future__ import annotations

import sys
import types

try:
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
except ImportError:  # a build without dynamo: nothing compiles our frames
    set_code_exec_strategy = None

_marked: set = set()


def skip_compiling(package: str) -> int:
    """Mark the code of every module of ``package`` imported so far (functions,
    methods, properties, nested functions) to run without dynamo; returns how
    many code objects were newly marked.

    Example::

        >>> skip_compiling("deferinit.fake") >= 0
        True
    """
    if set_code_exec_strategy is None:
        return 0
    skip = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
    n = 0
    prefix = package + "."
    for name, module in list(sys.modules.items()):
        if module is None or not (name == package or name.startswith(prefix)):
            continue
        for code in _codes(module):
            if code not in _marked:
                _marked.add(code)
                set_code_exec_strategy(code, skip)
                n += 1
    return n


def not_inlined(fn):
    """Flag ``fn`` as ``torch.compiler.disable`` does: dynamo calls it instead of
    tracing into it (for functions made at run time; module-level ones are
    flagged by :func:`skip_compiling`).

    Example::

        >>> not_inlined(lambda: 1)._torchdynamo_disable
        True
    """
    fn._torchdynamo_disable = True
    fn._torchdynamo_disable_msg = "deferinit's own code runs as written"
    return fn


def _codes(module):
    # Only code written in the module's own file: a decorator's wrapper
    # (contextlib.contextmanager's) carries our __module__ and its own code,
    # shared with every other user of that decorator.
    filename = getattr(module, "__file__", None)
    seen: set = set()
    stack = []
    for fn in _functions_of(vars(module).values(), module.__name__):
        inner = getattr(fn, "__wrapped__", fn)
        code = getattr(inner, "__code__", None)
        if not isinstance(code, types.CodeType) or code.co_filename != filename:
            continue
        for f in (fn, inner):
            try:
                not_inlined(f)
            except (AttributeError, TypeError):
                pass
        stack.append(code)
    while stack:
        code = stack.pop()
        if id(code) in seen:
            continue
        seen.add(id(code))
        yield code
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))


def _functions_of(values, module_name: str):
    for value in values:
        if isinstance(value, type):
            if value.__module__ == module_name:
                yield from _functions_of(vars(value).values(), module_name)
            continue
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, property):
            yield from _functions_of((value.fget, value.fset, value.fdel), module_name)
            continue
        if callable(value) and getattr(value, "__module__", None) == module_name:
            yield value


def forget_cached(replacements) -> None:
    """Clear torch.compile's caches of torch's functions that hold one of ours.

    Dynamo looks torch's functions and ``torch.Tensor``'s methods up once
    (``trace_rules``: which are ops, which are skipped) and keeps the objects
    the names held then; its import does it, and creating an optimizer imports
    it, often while a deferred model waits with torch's random functions
    diverted.  Once ours are taken away, a cache holding them would make
    dynamo skip ``torch.randn`` for good (a graph break).  Cleared with
    dynamo's own ``clear_lru_cache``, only where a cache holds ours; rebuilt
    at the next compile.

    Example::

        >>> forget_cached({"randn": object()})   # nothing cached holds it
    """
    rules = sys.modules.get("torch._dynamo.trace_rules")
    caches = [getattr(rules, name, None) for name in ("get_torch_obj_rule_map", "get_tensor_method")]
    clear = getattr(rules, "clear_lru_cache", None)
    if clear is None or not all(hasattr(fn, "cache_info") for fn in caches):
        return  # no dynamo, or one whose caches are not these
    ours = list(replacements.values())
    if any(fn.cache_info().currsize and _holds_any(fn(), ours) for fn in caches):
        clear()


def _holds_any(cache, values) -> bool:
    for value in values:
        try:
            if value in cache:
                return True
        except TypeError:  # unhashable: no cache keyed by objects holds it
            continue
    return False

