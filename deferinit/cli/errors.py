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


def one_line(e: BaseException) -> str:
    """An exception's whole message on one line: its lines joined, so that a
    message such as a validator's ``"...error for field 'x':\\n    TypeError: ..."``
    is not cut after its first line.

    Example::

        >>> one_line(ValueError("Validation error for field 'heads':\\n    TypeError: expected int"))
        "Validation error for field 'heads': TypeError: expected int"
    """
    lines = [line.strip() for line in str(e).splitlines()]
    text = " ".join(line for line in lines if line)
    return text or "(no message)"
