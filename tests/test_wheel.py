"""The wheel a user installs: only ``deferinit`` at the top, every module of the
repository inside it, and the tiny demo running from it in a fresh venv,
outside the source tree.

The wheel is built from a copy of the packaging files and the three package
folders (so nothing but pyproject.toml decides what goes in), installed
with ``pip install --no-deps`` into a new venv that sees this venv's
site-packages through a ``.pth`` line: torch, numpy and graphviz come from
there, as from a user's own environment (a path in a ``.pth`` is added to
``sys.path`` without running that directory's own ``.pth`` files, so this
checkout's editable install stays out of sight).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = {"deferinit": "deferinit", "fake": "deferinit/fake", "materialize": "deferinit/materialize"}
SUBPACKAGES = {"deferinit", "deferinit.fake", "deferinit.materialize", "deferinit.materialize.checkpoint",
               "deferinit.cli", "deferinit.dot", "deferinit.ir", "deferinit.random", "deferinit.planning"}


def _source_modules() -> set[str]:
    """Every ``.py`` file of the package folders, as its path inside the wheel."""
    found = set()
    for folder, inside in FOLDERS.items():
        base = os.path.join(ROOT, folder)
        for here, dirs, names in os.walk(base):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in names:
                if name.endswith(".py"):
                    rel = os.path.relpath(os.path.join(here, name), base)
                    found.add(f"{inside}/{rel}".replace(os.sep, "/"))
    return found


def _run(args, **kwargs):
    out = subprocess.run(args, capture_output=True, text=True, timeout=600, **kwargs)
    assert out.returncode == 0, f"{' '.join(map(str, args))} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    for folder in FOLDERS:
        shutil.copytree(os.path.join(ROOT, folder), src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "--disable-pip-version-check", "-q", "-w", str(dist), str(src)])
    (path,) = [p for p in dist.iterdir() if p.suffix == ".whl"]
    return str(path)


def test_the_wheel_holds_deferinit_only_and_all_of_it(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"deferinit", "deferinit-0.1.0.dist-info"}, sorted(top)
    modules = {n for n in names if n.endswith(".py")}
    missing = _source_modules() - modules
    assert not missing, f"not in the wheel (add their package to pyproject.toml): {sorted(missing)}"
    packages = {n[: -len("/__init__.py")].replace("/", ".") for n in modules if n.endswith("/__init__.py")}
    assert SUBPACKAGES <= packages, sorted(packages)
    with zipfile.ZipFile(wheel) as z:
        entry_points = z.read("deferinit-0.1.0.dist-info/entry_points.txt").decode()
    assert "deferinit = deferinit.cli:main" in entry_points


def test_the_tiny_demo_runs_from_the_wheel_in_a_fresh_venv(wheel, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip()
    # torch, numpy, graphviz (and pip) from this venv, as from the user's environment.
    with open(os.path.join(site, "outer.pth"), "w") as f:
        f.write(sysconfig.get_path("purelib") + "\n")
    _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check", "-q",
          "--target", site, wheel])
    elsewhere = tmp_path / "work"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    check = (
        "import importlib.util, deferinit, deferinit.materialize.checkpoint, deferinit.cli, deferinit.dot; "
        "print(deferinit.__file__); "
        "print(importlib.util.find_spec('fake'), importlib.util.find_spec('materialize'))"
    )
    out = _run([str(python), "-c", check], cwd=elsewhere, env=env).stdout.split("\n")
    assert out[0].startswith(site), out[0]  # the installed copy, not this checkout
    assert out[1] == "None None", out[1]
    demo = _run([str(python), "-m", "deferinit", "demo", "--size", "tiny"], cwd=elsewhere, env=env)
    assert "bit-identical" in demo.stdout, demo.stdout[-3000:]
