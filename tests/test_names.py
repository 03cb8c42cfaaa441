"""deferinit claims one importable name: a user's own ``fake.py`` or
``materialize.py`` beside their script shadows nothing of ours."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from deferinit import deferred_init, materialize_module
    from deferinit.fake import fake_mode, is_fake
    from deferinit.materialize import load_checkpoint, materialize_tensor
    import deferinit.materialize.distributed

    torch.manual_seed(0)
    m = deferred_init(torch.nn.Linear, 4, 3)
    materialize_module(m)
    torch.manual_seed(0)
    eager = torch.nn.Linear(4, 3)
    assert torch.equal(m.weight, eager.weight) and torch.equal(m.bias, eager.bias)
    with fake_mode():
        assert is_fake(torch.ones(2))
    import fake, materialize  # the user's own modules
    assert fake.MINE and materialize.MINE
    ours = sorted(n for n in sys.modules if n.split(".")[0] in ("fake", "materialize") and n not in ("fake", "materialize"))
    print("ok", ours)
    """
)


def test_a_script_beside_its_own_fake_and_materialize_modules(tmp_path):
    (tmp_path / "fake.py").write_text("MINE = True\n")
    (tmp_path / "materialize.py").write_text("MINE = True\n")
    (tmp_path / "script.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "script.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok []"


def test_no_top_level_fake_or_materialize_after_importing_everything():
    # Nothing of ours is reachable under the old top-level names in this
    # process either (the suite imports every module of the project).
    import deferinit.cli  # noqa: F401
    import deferinit.materialize.checkpoint  # noqa: F401
    import deferinit.materialize.distributed  # noqa: F401

    stray = sorted(n for n in sys.modules if n.split(".")[0] in ("fake", "materialize"))
    assert not stray, stray
