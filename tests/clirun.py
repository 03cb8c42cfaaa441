"""Running ``python -m deferinit`` as a user does, for the command-line tests."""

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(*args, cwd, path=None, timeout=240, env_extra=None):
    """``python -m deferinit ARGS`` in ``cwd``; returns the CompletedProcess."""
    env = dict(os.environ)
    env.update(env_extra or {})
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONWARNINGS"] = "ignore"
    if path is not None:
        env["PATH"] = path
    return subprocess.run(
        [sys.executable, "-m", "deferinit", *map(str, args)],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
    )


def row(out: str, label: str) -> list[str]:
    """The cells of the table row that starts with ``label``."""
    for line in out.splitlines():
        if line.strip().startswith(label + " ") or line.strip() == label:
            return re.split(r"\s{2,}", line.strip())
    raise AssertionError(f"no row {label!r} in:\n{out}")
