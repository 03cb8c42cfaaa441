"""The library call the user's code made that runs now, for messages.

An operation on fakes deep inside a library (an observer's ``copy_``
inside ``torch.ao.quantization.quantize_dynamic``) is best explained by the
call the user made: :func:`library_call` names it from the Python stack.
Computed only when a message needs it.
"""

from __future__ import annotations

import os
import sys
import sysconfig

import torch

# A module's __call__ is not the call the user means (the forward it runs is).
_CALL_IMPL = frozenset({torch.nn.Module._call_impl.__code__, torch.nn.Module._wrapped_call_impl.__code__})


def _folder(module) -> str:
    return os.path.dirname(os.path.abspath(module.__file__)) + os.sep


_places: list = []


def _ours_and_libraries() -> tuple:
    """(folders of this toolkit's code, folders libraries live in), found once."""
    if not _places:
        import importlib.util

        ours = {_folder(sys.modules["deferinit.fake"])}
        for name in ("deferinit", "deferinit.materialize"):
            spec = importlib.util.find_spec(name)
            if spec is not None and spec.origin:
                ours.add(os.path.dirname(os.path.abspath(spec.origin)) + os.sep)
        paths = sysconfig.get_paths()
        libraries = {os.path.abspath(paths[k]) + os.sep for k in ("purelib", "platlib", "stdlib", "platstdlib") if paths.get(k)}
        libraries.add(_folder(torch))
        _places.append((tuple(ours), tuple(libraries)))
    return _places[0]


def library_call() -> str | None:
    """The library function the user's code called that runs now, as
    ``"torch.ao.quantization.quantize.quantize_dynamic (called at train.py:12)"``:
    the outermost library frame below the innermost frame of the user's code
    (this toolkit's frames, a module's ``__call__`` and decorators' wrappers
    do not count).  None
    when the user's own code makes the call.  For messages only: it walks
    the Python stack.

    Example::

        >>> library_call() is None  # called from the user's own code
        True
    """
    ours, libraries = _ours_and_libraries()
    frame = sys._getframe(1)
    library = wrapper = None
    while frame is not None:
        code = frame.f_code
        filename = code.co_filename
        if filename.startswith("<frozen "):
            kind = "library"
        else:
            filename = os.path.abspath(filename)
            kind = "ours" if filename.startswith(ours) else "library" if filename.startswith(libraries) else "user"
        if kind == "user":
            library = library or wrapper
            if library is None:
                return None
            name = f"{library.f_globals.get('__name__', '?')}.{getattr(library.f_code, 'co_qualname', library.f_code.co_name)}"
            return f"{name} (called at {os.path.basename(filename)}:{frame.f_lineno})"
        if kind == "library" and code not in _CALL_IMPL:
            # A decorator's wrapper (a closure: typing_extensions.deprecated
            # around quantize_dynamic) is not the function called.
            if "<locals>" in getattr(code, "co_qualname", ""):
                wrapper = wrapper or frame
            else:
                library = frame
        frame = frame.f_back
    return None
