"""Known values (issues 13, 20): fakes made from Python numbers, shapes and
``arange``, and what is computed from them alone, keep the value eager
PyTorch gives, up to a size limit; anything that depends on unknown data
raises.

The reference is always the same program run eagerly on real tensors.
"""

import math

import pytest
import torch

from deferinit.fake import FakeDataAccessError, fake_mode, is_fake
from deferinit.fake.constants import KNOWN_LIMIT_BYTES


def _scalar_programs():
    def counter():
        s = torch.tensor(0.0)
        s += 1
        s.add_(torch.tensor(1.0), alpha=2.0)
        return s

    def bias_correction():
        step = torch.tensor(3.0)
        return 1 - 0.9 ** step

    def chain():
        s = torch.tensor(2.0, dtype=torch.float64)
        return ((s * 2 + 1).sqrt() / 3).to(torch.float32).exp()

    def integers():
        n = torch.tensor(7)
        return (n // 2) * 3 % 5

    def factories():
        return torch.full((), 2.5) + torch.zeros(()) + torch.ones(1) * torch.arange(1, 2)

    def comparisons():
        s = torch.tensor(1.5)
        return torch.where(s > 1, s, -s)

    def through_a_view():
        s = torch.zeros(1)
        v = s.view(())
        v.fill_(4.0)
        return s[0] + v

    def foreach():
        steps = [torch.tensor(0.0), torch.tensor(5.0)]
        torch._foreach_add_(steps, torch.tensor(1.0), alpha=1.0)
        return steps[0] * 10 + steps[1]

    def positions():
        # transformers' find_packed_sequence_indices on position ids from arange
        ids = torch.arange(0, 4096).unsqueeze(0).expand(8, -1)
        diff = torch.diff(ids, prepend=ids[:, :1] - 1, dim=-1)
        return ((diff != 1).cumsum(-1)[:, -1] == 0).all()

    def shapes():
        x = torch.randn(3, 5)  # unknown values, known shape
        return torch.tensor(x.shape).prod() + torch.full(x.shape, 2.0).sum()

    def reductions():
        return torch.ones(300, 7).cumsum(0)[-1].mean() + torch.arange(10.0).std()

    return [counter, bias_correction, chain, integers, factories, comparisons, through_a_view, foreach, positions,
            shapes, reductions]


@pytest.mark.parametrize("program", _scalar_programs(), ids=lambda p: p.__name__)
def test_known_values_are_eagers(program):
    real = program()
    with fake_mode():
        fake = program()
    assert is_fake(fake)
    assert fake.item() == real.item()
    assert fake.tolist() == real.tolist()
    assert float(fake) == float(real) and bool(fake) == bool(real)


def test_views_share_the_value_and_writes_reach_every_alias():
    with fake_mode():
        s = torch.tensor(1.0)
        e = s.expand(3)  # more than one element, but a view of a known memory
        d = s.detach()
        s.mul_(5)
    assert e.tolist() == [5.0, 5.0, 5.0] and d.item() == 5.0


@pytest.mark.parametrize(
    "unknown",
    [
        lambda: torch.rand(()),                     # random
        lambda: torch.empty(()),                    # uninitialised, eagerly too
        lambda: torch.randn(3).sum(),               # computed from random values
        lambda: torch.empty(4, 4).fill_(1)[0, 0],   # a write into unknown memory leaves it unknown
        lambda: torch.tensor(2.0) * torch.rand(2).mean(),
        # more than the limit: too costly to know
        lambda: torch.ones(KNOWN_LIMIT_BYTES // 4 + 1).sum(),
        lambda: torch.arange(KNOWN_LIMIT_BYTES // 8 + 1)[-1],
    ],
)
def test_values_that_need_data_stay_unknown(unknown):
    with fake_mode():
        t = unknown()
    with pytest.raises(FakeDataAccessError, match=r"item\(\) needs the data of a fake tensor"):
        t.item()


def test_a_write_of_unknown_data_forgets_the_value_of_every_alias():
    with fake_mode():
        s = torch.tensor(1.0)
        v = s.view(1)
        s.add_(torch.randn(3).sum())
    for t in (s, v):
        with pytest.raises(FakeDataAccessError):
            t.item()


def test_a_grown_storage_forgets_its_value():
    with fake_mode():
        s = torch.tensor([3.0])
        s.untyped_storage().resize_(8)
    with pytest.raises(FakeDataAccessError):
        s.item()


def test_values_on_a_fake_device():
    with fake_mode(fake_cuda=True):
        s = torch.tensor(2.0, device="cuda")
        t = (s * 3).cpu()
    assert s.device.type == "cuda" and s.item() == 2.0 and t.item() == 6.0


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad"])
def test_optimizers_step_on_fakes_and_count_as_eager(name, foreach):
    def train():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        kwargs = {"momentum": 0.9} if name == "SGD" else {}
        opt = getattr(torch.optim, name)(model.parameters(), lr=0.01, foreach=foreach, **kwargs)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for _ in range(3):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            scheduler.step()
        state = opt.state[model[0].weight]
        return model, {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}, opt.param_groups[0]["lr"]

    real_model, real_state, real_lr = train()
    with fake_mode():
        fake_model, fake_state, fake_lr = train()
    assert fake_lr == real_lr
    assert sorted(fake_state) == sorted(real_state)
    for key, real in real_state.items():
        fake = fake_state[key]
        assert is_fake(fake) and (fake.shape, fake.dtype) == (real.shape, real.dtype)
        if key == "step":
            assert fake.item() == real.item() == 3.0
    for p in fake_model.parameters():
        assert is_fake(p)


def test_a_tensor_learning_rate_is_a_known_value():
    with fake_mode():
        lr = torch.tensor(0.01)
        p = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.Adam([p], lr=lr, foreach=False)
        p.sum().backward()
        opt.step()
    assert math.isclose(opt.param_groups[0]["lr"].item(), 0.01, rel_tol=1e-6)
    assert opt.state[p]["step"].item() == 1.0
