"""``deferinit plan``: one training step of a deferred model, measured on fake devices.

The command line of :mod:`deferinit.planning` (which describes the step it
measures): it parses the options, builds the model deferred on the device
asked for (``cuda`` by default, fake on a machine without one), makes a
:class:`deferinit.planning.Recipe` of the training options, shards with
FSDP2 over ``--shard N`` ranks of :func:`deferinit.planning.fake_ranks`,
and prints and writes what :func:`deferinit.planning.plan_step` measured
(``--memory-timeline``, ``--memory-snapshot``).  Nothing is allocated.

Example::

    $ deferinit plan deferinit.demo:Llama --dtype bfloat16 --batch 1x4096 --shard 8
    $ deferinit plan deferinit.demo:Llama --mixed-precision bf16 --checkpointing --batch 2x4096 --shard 8
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import time

import torch

from deferinit.fake import fake_mode

from ..planning import FakeProcessGroupError, Recipe, Timeline, fake_ranks, plan_step, timeline_html, timeline_svg
from ..planning.recipe import blocks, check_master_weights, check_optimizer_args, optimizer_class
from ..planning.report import format_plan, row_labels
from ..planning.step import make_inputs, vocabulary
from .errors import UsageError
from .targets import build, load_target, parse_kwargs


def parse_shape(text: str, what: str) -> tuple[int, ...]:
    """``"1x4096"`` -> ``(1, 4096)``.

    Example::

        >>> parse_shape("2x3x32x32", "--input")
        (2, 3, 32, 32)
    """
    if not re.fullmatch(r"\d+(x\d+)*", text.strip()):
        raise UsageError(f"{what} {text!r}: expected sizes joined by x, e.g. 1x4096")
    return tuple(int(n) for n in text.strip().split("x"))


def parse_input(text: str) -> tuple[tuple[int, ...], torch.dtype | None]:
    """``"2x3x32x32"`` or ``"2x16:int64"``: a shape, and a dtype (None: the model's).

    Example::

        >>> parse_input("2x16:int64")
        ((2, 16), torch.int64)
    """
    shape, _, dtype = text.partition(":")
    if dtype:
        value = getattr(torch, dtype.strip().removeprefix("torch."), None)
        if not isinstance(value, torch.dtype):
            raise UsageError(f"--input {text!r}: {dtype!r} is not a torch dtype (float32, bfloat16, int64...)")
        return parse_shape(shape, "--input"), value
    return parse_shape(shape, "--input"), None


def _inputs(model, batch, extra, device):
    """The step's inputs (:func:`deferinit.planning.step.make_inputs`), refused in the options' words."""
    if batch is not None:
        if len(batch) != 2:
            raise UsageError(f"--batch takes BATCHxSEQUENCE, e.g. 1x4096 (got {'x'.join(map(str, batch))})")
        if vocabulary(model) is None:
            raise UsageError("--batch makes token ids, and the model has no nn.Embedding nor config.vocab_size; "
                             "use --input SHAPE for other inputs")
    return make_inputs(model, batch, extra, device)


@contextlib.contextmanager
def _fake_ranks(world_size: int, rank: int, device_type: str):
    """:func:`deferinit.planning.fake_ranks`, its refusal said as ``--shard``'s."""
    with contextlib.ExitStack() as stack:
        try:
            mesh = stack.enter_context(fake_ranks(world_size, rank, device_type))
        except FakeProcessGroupError as e:
            raise UsageError(f"--shard needs {e.needs}") from None
        yield mesh


def _device(model, fallback) -> torch.device:
    for t in model.parameters():
        return t.device
    return torch.device(fallback)


_LOW = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def recipe_of(opts) -> Recipe:
    """The training recipe the options ask for (see ``deferinit plan --help``).

    Example::

        >>> from deferinit.cli import make_parser
        >>> opts = make_parser().parse_args(["plan", "m.py:f", "--optimizer", "sgd", "--optimizer-arg", "lr=0.1",
        ...                                  "--mixed-precision", "bf16", "--accumulate", "4"])
        >>> recipe_of(opts)
        Recipe(optimizer='sgd', optimizer_args={'lr': 0.1}, foreach=None, mixed_precision=torch.bfloat16, checkpointing=False, accumulate=4)
    """
    try:
        # module:Class imported as TARGET is (file.py:Class too, the current directory on the path)
        cls = optimizer_class(opts.optimizer, load=load_target)
    except ValueError as e:
        raise UsageError(f"--optimizer {opts.optimizer}: {e}") from None
    optimizer = cls if ":" in opts.optimizer else opts.optimizer
    try:
        args = parse_kwargs(opts.optimizer_arg)
    except UsageError as e:
        raise UsageError(str(e).replace("-k", "--optimizer-arg")) from None
    try:
        check_optimizer_args(Recipe(optimizer=optimizer, optimizer_args=args))
    except ValueError as e:
        raise UsageError(f"--optimizer-arg: {e}") from None
    low = None
    if opts.mixed_precision is not None:
        low = _LOW.get(opts.mixed_precision.lower().removeprefix("torch."))
        if low is None:
            raise UsageError(f"--mixed-precision {opts.mixed_precision!r}: expected bf16 or fp16")
    if opts.accumulate is not None and opts.accumulate < 1:
        raise UsageError(f"--accumulate must be at least 1, got {opts.accumulate}")
    return Recipe(optimizer=optimizer, optimizer_args=args, foreach=opts.foreach, mixed_precision=low,
                  checkpointing=opts.checkpointing, accumulate=opts.accumulate or 1)


def _check_outputs(opts) -> None:
    for path, exts, what in ((opts.memory_timeline, (".svg", ".html", ".htm"), "--memory-timeline"),
                             (opts.memory_snapshot, (".pickle", ".pkl"), "--memory-snapshot")):
        if path is None:
            continue
        if not path.lower().endswith(exts):
            raise UsageError(f"{what} {path!r}: the file name must end in {' or '.join(exts)}")
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise UsageError(f"{what} {path!r}: no such directory {folder}")


def _check_recipe(model, recipe: Recipe, opts, built: str) -> None:
    """What the recipe cannot do to this model, as usage errors (before planning);
    ``built`` is :func:`~deferinit.cli.targets.build`'s text of the dtype used and why."""
    if recipe.mixed_precision is not None:
        try:
            check_master_weights(model, recipe.mixed_precision)
        except ValueError as e:
            raise UsageError(f"--mixed-precision: {e} ({_float32_build(opts, built)})") from None
    if recipe.checkpointing and not getattr(model, "supports_gradient_checkpointing", False) and not blocks(model):
        raise UsageError(f"--checkpointing checkpoints each block of an nn.ModuleList, and "
                         f"{type(model).__name__} has none")


def _float32_build(opts, built: str) -> str:
    """How to build in float32, by where the low dtype came from."""
    if opts.dtype:
        return f"pass --dtype float32 instead of --dtype {opts.dtype}"
    if "--dtype overrides it" in built:  # the config's dtype (targets.build says so)
        return f"pass --dtype float32, which overrides {built.partition('(')[2].partition(';')[0]}"
    return ("pass --dtype float32 (the default dtype while building); parameters the model's code makes in a "
            "fixed dtype stay so: plan those without --mixed-precision")


def plan(opts, out) -> int:
    batch = parse_shape(opts.batch, "--batch") if opts.batch else None
    extra = [parse_input(t) for t in opts.input or ()]
    if batch is None and not extra:
        raise UsageError("plan needs inputs: --batch BxS (token ids) and/or --input SHAPE (repeatable)")
    if opts.shard is not None and opts.shard < 1:
        raise UsageError(f"--shard must be at least 1, got {opts.shard}")
    if opts.rank is not None and (opts.shard is None or not 0 <= opts.rank < opts.shard):
        raise UsageError("--rank R needs --shard N with 0 <= R < N")
    recipe = recipe_of(opts)
    _check_outputs(opts)
    if opts.device is None:
        opts.device = "cuda"
    model, build_seconds, _, call, dtype = build(opts)
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"{call} returned a {type(model).__name__}, not an nn.Module; plan needs a module")
    device = _device(model, opts.device)
    _check_recipe(model, recipe, opts, dtype)
    rank = opts.rank or 0
    timeline = Timeline() if (opts.memory_timeline or opts.memory_snapshot) else None
    t0 = time.perf_counter()
    ranks = _fake_ranks(opts.shard, rank, device.type) if opts.shard else contextlib.nullcontext()
    with ranks as mesh, fake_mode(fake_cuda=True):
        model.train()
        args, kwargs, ids = _inputs(model, batch, extra, device)
        measured = plan_step(model, args, kwargs, recipe, mesh=mesh, token_ids=ids, timeline=timeline)
    seconds = time.perf_counter() - t0
    setup = {
        "device": device, "batch": batch, "inputs": extra, "optimizer": measured.recipe[0],
        "recipe": measured.recipe[1:], "shard": opts.shard, "rank": rank, "dtype": dtype, "accumulate": recipe.accumulate,
    }
    report = format_plan(model, measured, call=call, setup=setup, seconds=seconds, build_seconds=build_seconds)
    print(report, file=out)
    _write_pictures(opts, model, measured, call, device, report, out)
    return 0


def _write_pictures(opts, model, measured, call, device, report, out) -> None:
    if measured.timeline is None:
        return
    if opts.memory_snapshot:
        with open(opts.memory_snapshot, "wb") as f:
            pickle.dump(measured.timeline.snapshot(), f)
        print(f"wrote {opts.memory_snapshot}: a memory snapshot for PyTorch's memory visualizer "
              "(https://pytorch.org/memory_viz, or python -m torch.cuda._memory_viz trace_plot FILE -o page.html)", file=out)
    if opts.memory_timeline:
        target = device if device in measured.timeline.devices() else measured.timeline.devices()[0]
        what = dict(title=f"{call}: one training step", row_of=row_labels(model, measured),
                    subtitle=f"{target}: {report.splitlines()[0].partition(': ')[2]}")
        if opts.memory_timeline.lower().endswith(".svg"):
            text = timeline_svg(measured.timeline, target, **what)
        else:
            text = timeline_html(measured.timeline, target, report=report, **what)
        with open(opts.memory_timeline, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {opts.memory_timeline}: {target}'s memory over the step", file=out)
