"""Errors the command line reports as one line on stderr, with an exit status."""

from __future__ import annotations


class CommandError(Exception):
    """A failure the command line reports as one line on stderr (exit status ``status``)."""

    status = 1


class UsageError(CommandError):
    """Bad input on the command line: an unknown target, a malformed ``-k``, a bad option."""

    status = 2


class TargetError(UsageError):
    """``TARGET`` does not name an importable callable."""


class ConstructorError(CommandError):
    """The target callable raised while it was being built deferred."""
