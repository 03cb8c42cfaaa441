"""The examples in the docstrings run and print what they say."""

import doctest
import importlib
import warnings

import pytest
import torch

MODULES = [
    "fake",
    "fake.tensor",
    "fake.first",
    "fake.mode",
    "fake.device",
    "fake.function",
    "fake.patch",
    "fake.subclass",
    "fake.storage_set",
    "fake.assign",
    "fake.reads",
    "fake.compiling",
    "fake.checks",
    "deferinit.binding",
    "fake.errors",
    "fake.storage",
    "fake.constants",
    "fake.metacache",
    "deferinit",
    "deferinit.session",
    "deferinit.view",
    "deferinit.patches",
    "deferinit.pending",
    "deferinit.plan",
    "deferinit.holdings",
    "deferinit.regions",
    "deferinit.boxes",
    "deferinit.effects",
    "deferinit.plain",
    "deferinit.liveness",
    "deferinit.text",
    "deferinit.cli.step",
    "deferinit.cli.plan",
    "deferinit.cli.planreport",
    "deferinit.cli.timeline",
    "deferinit.cli.memplot",
    "deferinit.cli.recipe",
    "materialize.replay",
    "materialize.evaluate",
    "materialize",
    "materialize.api",
    "materialize.autograd",
    "materialize.gradcalls",
    "materialize.graphcheck",
    "materialize.checkpoint",
    "materialize.checkpoint.api",
    "materialize.checkpoint.capture",
    "materialize.checkpoint.copying",
    "materialize.checkpoint.entries",
    "materialize.checkpoint.loading",
    "materialize.checkpoint.matching",
    "materialize.checkpoint.sources",
    "materialize.checkpoint.index",
    "materialize.checkpoint.safetensors_header",
    "materialize.checkpoint.torch_zip",
    "materialize.checkpoint.torch_pickle",
    "materialize.checkpoint.pickle_scan",
    "materialize.checkpoint.torch_legacy",
    "materialize.checkpoint.nested",
    "materialize.checkpoint.files",
    "materialize.checkpoint.undo",
    "materialize.checkpoint.fingerprints",
]


def _globals(module):
    from deferinit import deferred_init, graph_of, is_deferred
    from fake import FakeTensor, fake_mode, is_fake, meta_like
    from materialize import load_checkpoint, materialize_module, materialize_tensor

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
