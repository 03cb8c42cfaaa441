"""The examples in the docstrings run and print what they say."""

import doctest
import importlib
import warnings

import pytest
import torch

MODULES = [
    "deferinit.fake",
    "deferinit.fake.tensor",
    "deferinit.fake.alive",
    "deferinit.fake.replaced",
    "deferinit.fake.mode",
    "deferinit.fake.device",
    "deferinit.fake.function",
    "deferinit.fake.patch",
    "deferinit.fake.gradmode",
    "deferinit.fake.calls",
    "deferinit.fake.subclass",
    "deferinit.fake.assign",
    "deferinit.fake.reads",
    "deferinit.fake.compiling",
    "deferinit.fake.checks",
    "deferinit.binding",
    "deferinit.fake.errors",
    "deferinit.fake.storage",
    "deferinit.fake.constants",
    "deferinit.fake.metacache",
    "deferinit.fake.extent",
    "deferinit.fake.cudnn",
    "deferinit",
    "deferinit.session",
    "deferinit.view",
    "deferinit.patches",
    "deferinit.random.pending",
    "deferinit.exclusive",
    "deferinit.ir.plan",
    "deferinit.holdings",
    "deferinit.wrappers",
    "deferinit.ir.regions",
    "deferinit.ir.boxes",
    "deferinit.ir.effects",
    "deferinit.plain",
    "deferinit.ir.liveness",
    "deferinit.random.mt19937",
    "deferinit.random.jumps",
    "deferinit.random.streams",
    "deferinit.text",
    "deferinit.planning",
    "deferinit.planning.step",
    "deferinit.planning.process_group",
    "deferinit.planning.foreach",
    "deferinit.planning.trackers",
    "deferinit.cli.plan",
    "deferinit.planning.report",
    "deferinit.planning.timeline",
    "deferinit.planning.picture",
    "deferinit.planning.recipe",
    "deferinit.materialize.replay",
    "deferinit.materialize.boxed",
    "deferinit.materialize.evaluate",
    "deferinit.materialize",
    "deferinit.materialize.api",
    "deferinit.materialize.pipeline",
    "deferinit.materialize.swap",
    "deferinit.materialize.reuse",
    "deferinit.materialize.autograd",
    "deferinit.materialize.graphcheck",
    "deferinit.materialize.checkpoint",
    "deferinit.materialize.checkpoint.api",
    "deferinit.materialize.checkpoint.capture",
    "deferinit.materialize.checkpoint.copying",
    "deferinit.materialize.checkpoint.entries",
    "deferinit.materialize.checkpoint.loading",
    "deferinit.materialize.checkpoint.matching",
    "deferinit.materialize.checkpoint.sources",
    "deferinit.materialize.checkpoint.index",
    "deferinit.materialize.checkpoint.archive",
    "deferinit.materialize.checkpoint.pickle_scan",
    "deferinit.materialize.checkpoint.nested",
    "deferinit.materialize.checkpoint.files",
    "deferinit.materialize.checkpoint.parallel",
    "deferinit.materialize.checkpoint.undo",
    "deferinit.materialize.checkpoint.fingerprints",
]


def _globals(module):
    from deferinit import deferred_init, graph_of, is_deferred
    from deferinit.fake import FakeTensor, fake_mode, is_fake, meta_like
    from deferinit.materialize import load_checkpoint, materialize_module, materialize_tensor

    names = dict(vars(module))
    names.update(
        torch=torch,
        deferred_init=deferred_init,
        is_deferred=is_deferred,
        graph_of=graph_of,
        materialize_module=materialize_module,
        materialize_tensor=materialize_tensor,
        load_checkpoint=load_checkpoint,
        fake_mode=fake_mode,
        is_fake=is_fake,
        meta_like=meta_like,
        FakeTensor=FakeTensor,
    )
    return names


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = doctest.testmod(
            module,
            globs=_globals(module),
            optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
            report=False,
        )
    assert result.failed == 0, f"{result.failed} docstring examples of {name} failed (run doctest on it to see)"
