"""deferinit.planning as a library (issue 28): called from Python without the
command line, its refusals are its own (ValueError, FakeProcessGroupError),
never the command line's UsageError, and the command line still words them
in its options' terms.  The figures themselves are checked against real
steps in test_plan.py and test_plan_recipes.py.
"""

import pytest
import torch
import torch.distributed as dist

from deferinit import deferred_init
from deferinit.cli import main
from deferinit.cli.errors import CommandError
from deferinit.demo import LLAMA_TINY, Llama
from deferinit.fake import fake_mode, is_fake
from deferinit.planning import FakeProcessGroupError, Recipe, fake_ranks, measure_step, plan_step
from deferinit.planning.step import make_inputs


@pytest.fixture()
def process_group():
    """A process group of the caller's own, as a training script would have."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_fake_ranks_refuses_beside_a_process_group_and_leaves_it(process_group):
    with pytest.raises(FakeProcessGroupError) as e:
        with fake_ranks(4, 0, "cpu"):
            pass
    assert not isinstance(e.value, CommandError)
    assert str(e.value) == "fake_ranks needs its own (fake) process group, and one is already initialized"
    assert e.value.needs == "its own (fake) process group, and one is already initialized"
    assert dist.is_initialized() and dist.group.WORLD is process_group and dist.get_world_size() == 2


def test_the_command_line_words_that_refusal_as_shard_needs(process_group, capsys):
    status = main(["plan", "torch.nn:Linear", "4", "4", "--input", "3x4", "--shard", "2"])
    err = capsys.readouterr().err
    assert status == 2
    assert err == "deferinit: error: --shard needs its own (fake) process group, and one is already initialized\n"
    assert dist.is_initialized() and dist.group.WORLD is process_group


def test_an_optimizer_named_by_module_path_needs_no_command_line():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    m = plan_step(model, (torch.randn(4, 8),), {}, Recipe(optimizer="torch.optim:SGD"))
    assert type(m.optimizer) is torch.optim.SGD and m.recipe == ["SGD"]
    for name, message in [("no_such_module_here:SGD", "cannot import no_such_module_here:SGD: No module named"),
                          ("torch.optim:Nope", "cannot import torch.optim:Nope: module 'torch.optim' has no attribute"),
                          ("torch.nn:Linear", "torch.nn:Linear is not a torch.optim.Optimizer subclass")]:
        with pytest.raises(ValueError, match=message) as e:
            plan_step(model, (torch.randn(4, 8),), {}, Recipe(optimizer=name))
        assert not isinstance(e.value, CommandError)


class _TakesLabels(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.head = torch.nn.Linear(8, 50)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.embed(input_ids))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_make_inputs_of_a_deferred_model():
    plain = torch.nn.Linear(4, 4)
    torch.manual_seed(0)
    with torch.device("cuda"):
        llama = deferred_init(Llama, LLAMA_TINY)
    labels = deferred_init(_TakesLabels)
    with fake_mode(fake_cuda=True):
        args, kwargs, ids = make_inputs(llama, batch=(2, 16), inputs=[((2, 4), torch.int64)])
        assert [tuple(a.shape) for a in args] == [(2, 16), (2, 4)] and args[0] is ids and kwargs == {}
        assert all(is_fake(a) and a.device == torch.device("cuda", 0) for a in args)
        assert args[1].dtype == torch.int64
        args, kwargs, ids = make_inputs(labels, batch=(3, 5))
        assert args == () and kwargs["input_ids"] is ids and kwargs["labels"] is ids
        m = measure_step(labels, args, kwargs, torch.optim.SGD(labels.parameters()), token_ids=ids)
    assert m.flops > 0
    with pytest.raises(ValueError, match=r"batch is \(BATCH, SEQUENCE\) of token ids, e.g. \(1, 4096\), got \(2, 3, 4\)"):
        make_inputs(llama, batch=(2, 3, 4))
    with pytest.raises(ValueError, match="Linear has no nn.Embedding nor config.vocab_size; give other inputs"):
        make_inputs(plain, batch=(2, 3))
