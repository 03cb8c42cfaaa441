"""Work put off until the first fake of the process is made.

The Fake layer's patches of ``torch.Tensor`` (``.data`` and ``set_`` in
:mod:`deferinit.fake.assign`) matter only once fakes exist: they are installed then, so that a process that imports
the packages and never makes a fake runs PyTorch's own functions at
PyTorch's own speed.
"""

from __future__ import annotations

import threading

#: True until the first fake is made (read by every fake's construction).
waiting = True
_hooks: list = []
_lock = threading.Lock()


def at_first_fake(hook) -> None:
    """Call ``hook()`` before the first fake of this process is made (now, if one was).

    Example::

        >>> import torch
        >>> from deferinit.fake import FakeTensor
        >>> f = FakeTensor(torch.empty(2, device="meta"), "cpu")   # fakes exist from here on
        >>> at_first_fake(lambda: print("called at once"))
        called at once
    """
    with _lock:
        if waiting:
            _hooks.append(hook)
            return
    hook()


def first_fake() -> None:
    """Run the hooks, once: a fake is about to be made (another thread making
    one meanwhile waits for them).

    Example::

        >>> first_fake()   # the hooks ran when the first fake was made
        >>> waiting
        False
    """
    global waiting
    with _lock:
        if waiting:
            while _hooks:  # a hook that raises leaves the rest for the next fake
                _hooks[0]()
                _hooks.pop(0)
            waiting = False
