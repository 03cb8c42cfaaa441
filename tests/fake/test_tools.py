"""PyTorch's own tools over fakes (issue 13): dispatch modes see every operator
whichever block is the outer one, tensor subclasses (DTensor) handle their
operators first, and the operators C++ composites issue on fake devices stay
on them.  References are the same programs run on real tensors.
"""

import contextlib

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils.flop_counter import FlopCounterMode

from deferinit.fake import fake_mode, is_fake


def _cnn_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 14 * 14, 10)
    )
    model(torch.randn(2, 3, 16, 16)).sum().backward()


def _flops(order):
    counter = FlopCounterMode(display=False)
    if order == "real":
        with counter:
            _cnn_step()
    elif order == "fake outside":
        with fake_mode(), counter:
            _cnn_step()
    else:
        with counter, fake_mode():
            _cnn_step()
    return counter.get_total_flops()


@pytest.mark.parametrize("order", ["fake outside", "fake inside"])
def test_flop_counter_counts_every_operator_in_either_order(order):
    assert _flops(order) == _flops("real") > 0


def _tracked_peak(order):
    tracker = MemTracker()
    outer, inner = {
        "real": (tracker, contextlib.nullcontext()),
        "fake outside": (fake_mode(), tracker),
        "fake inside": (tracker, fake_mode()),
    }[order]
    with outer, inner:
        torch.manual_seed(0)
        model = torch.nn.Linear(32, 32)
        tracker.track_external(model)
        model(torch.randn(16, 32)).relu().sum().backward()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]


@pytest.mark.parametrize("order", ["fake outside", "fake inside"])
def test_memory_tracker_sees_every_operator_in_either_order(order):
    assert _tracked_peak(order) == _tracked_peak("real")


class Counting(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def test_the_mode_stack_is_restored_exactly_and_own_modes_keep_their_order():
    before = _get_current_dispatch_mode_stack()
    outer, inner = Counting(), Counting()
    with outer:
        with fake_mode():
            stack = _get_current_dispatch_mode_stack()
            assert stack[-1] is outer  # the foreign mode stays on top
            with inner, fake_mode():
                assert _get_current_dispatch_mode_stack()[-1] is inner
                t = torch.ones(3) * 2
            assert is_fake(t)
        assert _get_current_dispatch_mode_stack() == before + [outer]
    assert _get_current_dispatch_mode_stack() == before
    assert torch.ops.aten.mul.Tensor in outer.seen and torch.ops.aten.mul.Tensor in inner.seen


def test_transformer_forward_and_python_tensor_methods():
    """Tensor.unflatten is Python calling its C method through super()."""
    torch.manual_seed(0)
    real = torch.nn.Transformer(16, 2, 1, 1, 32, batch_first=True, dropout=0.0)
    out = real(torch.randn(2, 5, 16), torch.randn(2, 3, 16))
    with fake_mode():
        model = torch.nn.Transformer(16, 2, 1, 1, 32, batch_first=True, dropout=0.0)
        fake = model(torch.randn(2, 5, 16), torch.randn(2, 3, 16))
        flat = torch.ones(2, 12).unflatten(1, (3, 4))
    assert fake.shape == out.shape and flat.shape == (2, 3, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_composites_on_a_fake_device_stay_on_it(dtype, dropout):
    """C++ composites build temporaries with a fake's options, whose C++ device
    is CPU on a build without CUDA: SDPA's masks, rms_norm's cast back."""
    with fake_mode(fake_cuda=True):
        q = torch.randn(2, 4, 8, 16, device="cuda", dtype=dtype, requires_grad=True)
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=dropout, is_causal=True)
        norm = torch.nn.functional.rms_norm(out, (16,), torch.ones(16, device="cuda", dtype=dtype))
        norm.sum().backward()
    assert out.device.type == norm.device.type == q.grad.device.type == "cuda"
    assert norm.dtype == dtype


def test_explicit_cpu_still_means_cpu():
    with fake_mode(fake_cuda=True):
        x = torch.ones(3, device="cuda")
        assert x.to("cpu").device.type == "cpu" and x.cpu().device.type == "cpu"
        assert torch.ones(2, device="cpu").device.type == "cpu"
        # what DTensor's .cpu() issues on its local tensor: an operator called directly
        assert torch.ops.aten._to_copy.default(x, device=torch.device("cpu")).device.type == "cpu"
        with pytest.raises(RuntimeError, match="same device"):
            x + torch.ones(3, device="cpu")


def test_tensor_subclasses_handle_their_operators_first():
    """DTensor desugars to operators on its local fake tensor; FSDP2 can shard inside fake_mode."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (4,))
        with fake_mode():
            model = torch.nn.Linear(16, 16)
            fully_shard(model, mesh=mesh)
            model(torch.randn(2, 16)).sum().backward()
        assert isinstance(model.weight, DTensor) and is_fake(model.weight._local_tensor)
        assert model.weight._local_tensor.shape == (4, 16)
        assert isinstance(model.weight.grad, DTensor) and model.weight.grad.shape == (16, 16)
    finally:
        dist.destroy_process_group()
