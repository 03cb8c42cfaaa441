"""Running ``python -m deferinit`` as a user does, for the command-line tests."""

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


# What other libraries log while transformers imports them, not the CLI's to
# say: torchao's PyPI wheel logs that its CUDA extensions do not load on a CPU
# build of torch ("Failed to load .../_C_mxfp8...so: ..."), and torch logs
# glog-style warnings ("W1129 07:28:25.728000 123 .../torch/utils/_pytree.py:630] ...")
# as torchao registers its enums.
_IMPORT_NOISE = re.compile(r"^(Failed to load \S+\.so: |[WI]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S*torch/\S+\.py:\d+\] )")


def without_import_noise(stderr: str) -> str:
    """``stderr`` without the lines libraries log as they are imported (above)."""
    return "".join(line for line in stderr.splitlines(keepends=True) if not _IMPORT_NOISE.match(line))


def run(*args, cwd, path=None, timeout=240, env_extra=None):
    """``python -m deferinit ARGS`` in ``cwd``; returns the CompletedProcess (its
    stderr without what libraries log as they are imported)."""
    env = dict(os.environ)
    env.update(env_extra or {})
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONWARNINGS"] = "ignore"
    if path is not None:
        env["PATH"] = path
    proc = subprocess.run(
        [sys.executable, "-m", "deferinit", *map(str, args)],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
    )
    proc.stderr = without_import_noise(proc.stderr)
    return proc


def row(out: str, label: str) -> list[str]:
    """The cells of the table row that starts with ``label``."""
    for line in out.splitlines():
        if line.strip().startswith(label + " ") or line.strip() == label:
            return re.split(r"\s{2,}", line.strip())
    raise AssertionError(f"no row {label!r} in:\n{out}")
