"""The shell examples of README.md and docs/*.md run as a reader would type them.

Two kinds of fenced blocks hold them:

* command blocks (```sh, ```bash, ```shell): every line that calls
  ``deferinit`` or ``python -m deferinit`` runs and must exit with status 0
  (lines of other programs, such as ``make demo``, are not run);
* transcripts (```console, ```text or a bare fence whose lines start with
  ``$ deferinit`` or ``$ python -m deferinit``): each command runs and its
  output (stdout, then stderr) must read as shown, up to durations
  (``19.6 ms``), the growth of resident memory, runs of spaces, and lines
  elided as ``...``.

A page's commands run through ``bash`` in one temporary directory per page,
offline, with ``deferinit`` and ``python`` on ``PATH`` being this checkout's.
The files the examples name (``config.json``, ``./my-checkpoint``,
``my_models.py``, a model id in the Hugging Face cache...) are made by
:func:`_page_files` before the page's commands run: small models under the
docs' file names, since the command lines, not the sizes, are what is tested
(the 70B runs are marked not run).  A rendered format (``-o x.svg``) without
Graphviz must fail as documented: status 1, the ``.dot`` written, and how to
install Graphviz said.

Blocks take the markers of tests/test_doc_examples.py on the line before
their fence: ``<!-- not run: REASON -->``, ``<!-- run if: CONDITION -->``.
See docs/testing.md.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from test_doc_examples import CONDITIONS, PAGES, ROOT

_FENCE = re.compile(r"^```(\w*)\s*$")
_MARK = re.compile(r"^<!--\s*(not run|run if):\s*(.*?)\s*-->\s*$")
_COMMAND_LANGS = {"sh", "bash", "shell"}
_TRANSCRIPT_LANGS = {"console", "text", ""}
_OURS = re.compile(r"^(deferinit|python3? -m deferinit)(\s|$)")
_DURATION = re.compile(r"\d+(?:\.\d+)? ?(?:ns|µs|us|ms|s|min)\b")
_RSS = re.compile(r"resident memory \+\d+(?:\.\d+)? (?:B|KiB|MiB|GiB)")
_RENDERED = re.compile(r"^\S*deferinit graph .*(?:-o|--output)\s+(\S+\.(?:svg|png|pdf))(\s|$)")


def shell_examples(text: str):
    """``(line, command, expected, mark)`` for every ``deferinit`` command of the
    page's shell blocks: ``expected`` is the transcript's output lines (None in a
    command block), ``mark`` the block's ``(kind, argument)`` or None."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        lang = fence.group(1)
        mark = _MARK.match(lines[i - 1]) if i else None
        mark = (mark.group(1), mark.group(2)) if mark else None
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        body = list(enumerate(lines[i + 1:end], start=i + 2))
        if lang in _COMMAND_LANGS:
            yield from _commands(body, mark)
        elif lang in _TRANSCRIPT_LANGS:
            yield from _transcript(body, mark)
        i = end + 1


def _commands(body, mark):
    pending, first = "", None
    for number, line in body:
        if line.rstrip().endswith("\\"):  # a continued command
            pending += line.rstrip()[:-1] + " "
            first = first or number
            continue
        command = _strip_comment(pending + line).removeprefix("$ ").strip()
        start, pending, first = first or number, "", None
        if _OURS.match(command):
            yield start, command, None, mark


def _transcript(body, mark):
    current = None
    for number, line in body:
        if line.startswith("$ "):
            if current:
                yield current
            command = _strip_comment(line[2:]).strip()
            current = (number, command, [], mark) if _OURS.match(command) else None
        elif current:
            current[2].append(line)
    if current:
        yield current


def _strip_comment(line: str) -> str:
    """The command without its trailing ``# comment`` (outside quotes)."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return line
    return shlex.join(words) if words else ""


def output_matches(expected: list[str], actual: str) -> bool:
    """Whether ``actual`` reads as the transcript's ``expected`` lines: durations and
    resident-memory growth may differ, runs of spaces count as one, and a line
    ``...`` stands for any number of lines."""
    patterns = [None if line.strip() == "..." else _line_pattern(line) for line in expected]
    while patterns and patterns[-1] is not None and not expected[len(patterns) - 1].strip():
        patterns.pop()  # blank lines at the end of the block
    got = [" ".join(line.split()) for line in actual.rstrip("\n").splitlines()]

    def match(p: int, g: int) -> bool:
        if p == len(patterns):
            return g == len(got)
        if patterns[p] is None:
            return any(match(p + 1, k) for k in range(g, len(got) + 1))
        return g < len(got) and patterns[p].fullmatch(got[g]) is not None and match(p + 1, g + 1)

    return match(0, 0)


def _line_pattern(line: str):
    text = " ".join(line.split())
    out, pos = [], 0
    for m in sorted([*_DURATION.finditer(text), *_RSS.finditer(text)], key=lambda m: m.start()):
        if m.start() < pos:
            continue
        out.append(re.escape(text[pos:m.start()]))
        out.append(r"resident memory \+[\d.]+ (?:B|KiB|MiB|GiB)" if m.group().startswith("resident")
                   else r"[\d.]+ ?(?:ns|µs|us|ms|s|min)")
        pos = m.end()
    out.append(re.escape(text[pos:]))
    return re.compile("".join(out))


def _runnable(page: str):
    with open(os.path.join(ROOT, page)) as f:
        examples = list(shell_examples(f.read()))
    run, skipped = [], []
    for line, command, expected, mark in examples:
        if mark is None:
            run.append((line, command, expected))
            continue
        kind, arg = mark
        if kind == "not run":
            assert arg, f"{page}:{line}: `<!-- not run: REASON -->` needs a reason"
            skipped.append((line, command, arg))
        else:
            assert arg in CONDITIONS, f"{page}:{line}: unknown condition {arg!r} (known: {', '.join(CONDITIONS)})"
            if CONDITIONS[arg]():
                run.append((line, command, expected))
            else:
                skipped.append((line, command, arg))
    return run, skipped


# -- the files the examples name ----------------------------------------------------------

_TINY_LLAMA = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=64,
    intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=8192, tie_word_embeddings=False, dtype="bfloat16",
)

_TINY_UNET = {
    "_class_name": "UNet2DConditionModel", "_diffusers_version": "0.42.1", "sample_size": 8, "in_channels": 4,
    "out_channels": 4, "layers_per_block": 1, "block_out_channels": [32, 64],
    "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"], "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
    "cross_attention_dim": 32, "attention_head_dim": 8, "norm_num_groups": 32,
}

_MY_MODELS = '''\
"""The models docs/cli.md names: my_models.py:build and my_models.py:ResNet."""
import torch
from torch import nn


def build(depth=2, width=64):
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


class Block(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class ResNet(nn.Module):
    def __init__(self, classes=10, width=16, blocks=2):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1))
        self.blocks = nn.Sequential(*[Block(width) for _ in range(blocks)])
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))
'''


def _page_files(cwd) -> dict:
    """Write the files the pages' commands name into ``cwd``; return the
    environment they need (a Hugging Face cache holding the model id named)."""
    config = json.dumps(_TINY_LLAMA, indent=2)
    (cwd / "config.json").write_text(config)
    (cwd / "llama-70b.json").write_text(config)
    (cwd / "my-checkpoint").mkdir()
    (cwd / "my-checkpoint" / "config.json").write_text(config)
    (cwd / "my_models.py").write_text(_MY_MODELS)
    (cwd / "my-unet").mkdir()
    (cwd / "my-unet" / "config.json").write_text(json.dumps(_TINY_UNET, indent=2))
    snapshot = cwd / "hf-cache" / "models--meta-llama--Llama-3.1-8B" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(config)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abcd")
    return {"HF_HUB_CACHE": str(cwd / "hf-cache")}


def _environment(cwd, extra: dict) -> dict:
    bin_dir = cwd / ".bin"
    bin_dir.mkdir(exist_ok=True)
    # Scripts, not symlinks: a symlink to the venv's python, called from
    # elsewhere, finds no pyvenv.cfg beside it and starts the base interpreter
    # without the venv's site-packages (nor the editable install that maps
    # deferinit.fake and deferinit.materialize to their folders).
    commands = {"deferinit": "-m deferinit ", "python": "", "python3": ""}
    for name, args in commands.items():
        script = bin_dir / name
        script.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {args}"$@"\n')
        script.chmod(0o755)
    env = dict(os.environ)
    env.update(extra)
    env["PATH"] = str(bin_dir) + os.pathsep + env.get("PATH", "")
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="ignore")
    env.pop("DEFERINIT_PROGRESS", None)
    return env


def _check(page, line, command, expected, proc, cwd) -> str | None:
    """Why the command's run does not do what the page shows, or None."""
    where = f"{page}:{line}: `{command}`"
    output = proc.stdout + proc.stderr
    if expected is not None:
        if output_matches(expected, output):
            return None
        return f"{where} printed (status {proc.returncode}):\n{output}\nwhere the page shows:\n" + "\n".join(expected)
    rendered = _RENDERED.search(command.replace("python -m deferinit", "deferinit"))
    if rendered and shutil.which("dot") is None:
        dot_file = re.sub(r"\.\w+$", ".dot", rendered.group(1))
        if proc.returncode == 1 and "apt-get install graphviz" in proc.stderr and (cwd / dot_file).exists():
            return None  # documented: without Graphviz the source is written and the command fails
        return f"{where}: without Graphviz, expected status 1 and {dot_file} written; got status {proc.returncode}:\n{output}"
    if proc.returncode != 0:
        return f"{where} exited with status {proc.returncode}:\n{output}"
    return None


def test_every_page_with_examples_is_listed():
    assert "README.md" in PAGES and os.path.join("docs", "cli.md") in PAGES


def test_blocks_commands_and_marks_are_read():
    page = (
        "<!-- not run: the 70B model takes minutes -->\n```sh\ndeferinit demo   # the demo\nmake test\n```\n"
        "```sh\npython -m deferinit inspect torch.nn:Linear \\\n  4 4\n```\n"
        "```text\n$ deferinit inspect torch.nn:Lineer 3 3\ndeferinit: error: no\n$ ls\nx\n```\n"
        "```python\ndeferinit = 1\n```\n"
    )
    assert list(shell_examples(page)) == [
        (3, "deferinit demo", None, ("not run", "the 70B model takes minutes")),
        (7, "python -m deferinit inspect torch.nn:Linear 4 4", None, None),
        (11, "deferinit inspect torch.nn:Lineer 3 3", ["deferinit: error: no"], None),
    ]


def test_transcripts_match_up_to_durations_spaces_and_elisions():
    expected = ["x: built deferred in 19.6 ms, resident memory +4.2 MiB", "", "  a      1", "...", "took 1.02 s", ""]
    assert output_matches(expected, "x: built deferred in 3.1 s, resident memory +12.0 KiB\n\n  a  1\nb\nc\ntook 9 ms\n")
    assert output_matches(expected, "x: built deferred in 3 ms, resident memory +1 MiB\n\na 1\ntook 2 s\n")
    assert not output_matches(expected, "x: built deferred in 3 ms, resident memory +1 MiB\n\na 2\ntook 2 s\n")
    assert not output_matches(expected, "x: built deferred in 3 ms, resident memory +1 MiB\n\na 1\n")
    assert not output_matches(["deferinit: error: bad"], "deferinit: error: bad\nmore\n")


def _examples():
    """``(page, line)`` of every example to run, for the test ids."""
    out = []
    for page in PAGES:
        run, skipped = _runnable(page)
        out += [(page, line) for line, _, _ in run]
    return out


_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2)
_PAGES_SET_UP: dict = {}


def _started(page: str, line: int, factory):
    """``(directory, command, expected, future)`` of the example at ``page:line``,
    started if it was not, and the page's next example started beside it (two
    at a time; each is its own Python, and none reads what another writes).
    The page's files are made once, in one directory for all its examples."""
    if page not in _PAGES_SET_UP:
        cwd = factory.mktemp(re.sub(r"\W", "_", page))
        _PAGES_SET_UP[page] = (cwd, _environment(cwd, _page_files(cwd)), _runnable(page)[0], {})
    cwd, env, run, futures = _PAGES_SET_UP[page]
    index = next(i for i, example in enumerate(run) if example[0] == line)
    for number, command, _ in run[index:index + 2]:
        if number not in futures:
            futures[number] = _POOL.submit(subprocess.run, ["bash", "-c", command], cwd=cwd, env=env,
                                           capture_output=True, text=True, timeout=600)
    _, command, expected = run[index]
    return cwd, command, expected, futures[line]


def test_marked_examples_say_why():
    for page in PAGES:
        _, skipped = _runnable(page)   # asserts that every condition is known
        for line, command, reason in skipped:
            assert reason, f"{page}:{line}: `{command}` is skipped without a reason"


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize(("page", "line"), _examples(), ids=[f"{p}:{n}" for p, n in _examples()])
def test_shell_example(page, line, tmp_path_factory):
    cwd, command, expected, future = _started(page, line, tmp_path_factory)
    failure = _check(page, line, command, expected, future.result(), cwd)
    assert failure is None, failure
