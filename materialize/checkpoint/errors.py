"""Errors of the checkpoint reader: a source ``load_checkpoint`` cannot use, or cannot read again.

``CheckpointError`` and its subclasses are raised by ``load_checkpoint``
(nothing recorded or loaded); ``CheckpointReadError`` while materializing a
recorded load (nothing changed).  ``deferinit`` exports them all; the
catalogue with causes and fixes is in ``docs/errors.md``.
"""

from __future__ import annotations

import errno
import os

from deferinit.errors import DeferredInitError, MaterializationError


class CheckpointError(DeferredInitError):
    """``load_checkpoint`` cannot use its source: a missing or unreadable file, a
    corrupt header, a format it does not know.  Nothing was recorded or loaded."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint, or a file its index names, does not exist.  Also a
    ``FileNotFoundError`` (``errno.ENOENT``, ``filename`` the path), as code
    written for ``torch.load`` and safetensors expects.  Nothing was recorded
    or loaded."""

    def __init__(self, message: str, filename: str | None = None):
        super().__init__(message)
        self.errno = errno.ENOENT
        self.strerror = os.strerror(errno.ENOENT)
        self.filename = filename

    def __str__(self) -> str:
        return self.args[0] if self.args else ""

    def __reduce__(self):
        return type(self), (str(self), self.filename)


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit the module: shapes differ, or (with
    ``strict=True``) keys are missing or unexpected.  Nothing was recorded or loaded."""


class CheckpointReadError(MaterializationError):
    """A checkpoint recorded by ``load_checkpoint`` could not be read while
    materializing (the file is gone, truncated or changed); nothing was changed."""
