"""The Fake layer: FakeTensor, fake_mode, is_fake, meta_like (issue 2).

Geometry is checked against the same modules built eagerly on CPU: a fake
must report exactly the shapes, strides and dtypes eager PyTorch gives.
"""

import threading

import pytest
import torch

from deferinit.fake import FakeDataAccessError, FakeTensor, UnsupportedOperatorError, fake_mode, is_fake, meta_like

CUDA = torch.device("cuda", 0)


def same_geometry(fake, real):
    assert fake.shape == real.shape
    assert fake.stride() == real.stride()
    assert fake.storage_offset() == real.storage_offset()
    assert fake.dtype == real.dtype
    assert fake.requires_grad == real.requires_grad


# -- the tensor itself ---------------------------------------------------------


def test_fake_tensor_reports_device_shape_dtype_strides_and_has_no_data():
    t = FakeTensor(torch.empty(2, 3, dtype=torch.float16, device="meta").t(), "cuda", requires_grad=True)
    assert t.device == CUDA and t.is_cuda and not t.is_cpu
    assert t.shape == (3, 2) and t.stride() == (1, 3) and t.dtype == torch.float16
    assert t.requires_grad and t.is_leaf
    assert t.is_meta is False
    assert t.get_device() == 0
    assert is_fake(t)
    shadow = meta_like(t)
    assert shadow.is_meta and not is_fake(shadow)
    assert shadow.shape == (3, 2) and shadow.stride() == (1, 3) and shadow.dtype == torch.float16
    storage = t.untyped_storage()
    assert storage.nbytes() == 12  # the size real memory would have, no bytes behind it
    with pytest.raises(FakeDataAccessError, match="tolist"):
        storage.tolist()


def test_shadow_must_be_meta():
    with pytest.raises(ValueError, match="meta"):
        FakeTensor(torch.empty(2), "cpu")


def test_meta_like_is_detached_and_rejects_real_tensors():
    with fake_mode():
        t = torch.ones(4, 4, requires_grad=True)[1:, ::2]
    m = meta_like(t)
    assert not m.requires_grad
    assert (m.shape, m.stride(), m.storage_offset()) == (t.shape, t.stride(), t.storage_offset())
    m.t_()  # changing the copy leaves the fake alone
    assert t.shape == (3, 2)
    with pytest.raises(ValueError, match="fake"):
        meta_like(torch.ones(2))
    with pytest.raises(ValueError, match="fake"):
        meta_like(torch.ones(2, device="meta"))


def test_repr_never_reads_data():
    with fake_mode(fake_cuda=True):
        t = torch.ones(2, 3, device="cuda")
        h = torch.ones(2, dtype=torch.float16)
    assert repr(t) == "tensor(..., size=(2, 3), device='cuda:0', fake=True)"
    assert repr(h) == "tensor(..., size=(2,), device='cpu', dtype=torch.float16, fake=True)"
    assert str(t) == repr(t)
    assert f"{t}" == repr(t)
    with fake_mode():
        p = torch.nn.Parameter(torch.ones(2))
    assert repr(p).startswith("Parameter containing:\ntensor(..., size=(2,)")


# -- dispatch and device rules ---------------------------------------------------


def test_in_place_op_returns_the_same_object_and_tracks_geometry():
    with fake_mode():
        t = torch.zeros(2, 3)
        assert t.add_(1) is t
        assert t.t_() is t
        assert t.shape == (3, 2) and t.stride() == (1, 3)
        assert t.unsqueeze_(0) is t and t.shape == (1, 3, 2)
        t.resize_(7)
        assert t.shape == (7,) and t.stride() == (1,)


def test_output_device_rules():
    with fake_mode(fake_cuda=True):
        c = torch.ones(3, device="cuda")
        x = torch.ones(3)
        # explicit device argument of a factory
        assert torch.zeros(2, device="cuda").device == CUDA
        assert torch.zeros_like(x, device="cuda").device == CUDA
        # common device of the tensors
        assert (c * 2).device == CUDA
        assert (x + x).device.type == "cpu"
        # a 0-dim CPU tensor yields to the others, as in eager
        assert (c + torch.tensor(2.0)).device == CUDA
        # no tensors and no device: CPU
        assert torch.zeros(2).device.type == "cpu"
        # moves
        assert c.cpu().device.type == "cpu" and x.cuda().device == CUDA
        assert x.to("cuda", torch.float16).device == CUDA
        assert c.to("cuda") is c
        assert torch.ones(2).type_as(c).device == CUDA
        assert c.new_zeros(2).device == CUDA and c.new_tensor([1.0]).device == CUDA
        # a real mismatch raises PyTorch's usual error
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            c + x
    # eager agrees on the 0-dim rule and on the mismatch for same-type devices
    assert (torch.ones(3, device="meta") + torch.tensor(2.0)).device.type == "meta"


def test_explicit_meta_stays_meta():
    with fake_mode():
        m = torch.empty(3, device="meta")
    assert not is_fake(m) and m.is_meta


def test_geometry_matches_eager_for_common_ops():
    real = torch.randn(4, 6)
    with fake_mode():
        fake = torch.empty(4, 6)
    cases = [
        lambda t: t.t(),
        lambda t: t[1:, ::2],
        lambda t: t.reshape(2, 12),
        lambda t: t.transpose(0, 1).contiguous(),
        lambda t: t.unsqueeze(1).expand(4, 3, 6),
        lambda t: t @ t.t(),
        lambda t: torch.cat([t, t], 1),
        lambda t: t.sum(0, keepdim=True),
        lambda t: t.to(torch.float16),
        lambda t: t.diagonal(),
        lambda t: t.narrow(1, 2, 3).select(0, 1),
    ]
    for case in cases:
        r, f = case(real), case(fake)
        assert is_fake(f)
        assert (f.shape, f.stride(), f.storage_offset(), f.dtype) == (r.shape, r.stride(), r.storage_offset(), r.dtype)
    parts = fake.split(2)
    assert [p.shape for p in parts] == [p.shape for p in real.split(2)]


# -- fake_mode ---------------------------------------------------------------------


def test_cuda_modules_on_a_cpu_only_build():
    with fake_mode(fake_cuda=True):
        ones = torch.ones(10, device="cuda")
        linear = torch.nn.Linear(4, 5, device="cuda")  # runs kaiming_uniform_
    assert ones.device == CUDA and ones.shape == (10,)
    assert linear.weight.device == CUDA and linear.bias.device == CUDA
    assert isinstance(linear.weight, torch.nn.Parameter) and linear.weight.requires_grad
    same_geometry(linear.weight, torch.nn.Linear(4, 5).weight)


@pytest.mark.parametrize(
    "ctor",
    [
        lambda **kw: torch.nn.TransformerEncoderLayer(16, 4, 32, **kw),
        lambda **kw: torch.nn.LSTM(8, 16, 2, **kw),
        lambda **kw: torch.nn.Conv2d(3, 8, 3, **kw),
        lambda **kw: torch.nn.Embedding(10, 4, padding_idx=0, **kw),
    ],
    ids=["TransformerEncoderLayer", "LSTM", "Conv2d", "Embedding"],
)
def test_modules_match_eager_geometry(ctor):
    eager = ctor()
    with fake_mode(fake_cuda=True):
        fake = ctor(device="cuda")
    eager_tensors = dict(eager.named_parameters()) | dict(eager.named_buffers())
    fake_tensors = dict(fake.named_parameters()) | dict(fake.named_buffers())
    assert eager_tensors.keys() == fake_tensors.keys()
    for name, r in eager_tensors.items():
        f = fake_tensors[name]
        assert is_fake(f) and f.device == CUDA, name
        same_geometry(f, r)
        assert type(f) is FakeTensor and isinstance(f, torch.nn.Parameter) == isinstance(r, torch.nn.Parameter)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only build's own error")
def test_without_fake_cuda_cuda_fails_as_pytorch_does():
    with pytest.raises(Exception) as eager_error:
        torch.ones(10, device="cuda")
    with fake_mode():
        # The build's own words: "Torch not compiled with CUDA enabled" on a
        # CPU build, "Found no NVIDIA driver ..." on a CUDA build without a GPU.
        with pytest.raises(type(eager_error.value)) as fake_error:
            torch.ones(10, device="cuda")
    assert str(fake_error.value) == str(eager_error.value)


def test_default_device_contexts_are_honoured():
    with torch.device("cuda"):
        with fake_mode(fake_cuda=True):
            a = torch.zeros(3)
            b = torch.nn.Linear(2, 2).weight
    assert a.device == CUDA and b.device == CUDA
    with fake_mode(fake_cuda=True):
        with torch.device("cuda"):
            c = torch.zeros(3)
    assert c.device == CUDA


def test_nested_modes_and_fakes_stay_fake():
    with fake_mode():
        a = torch.ones(2)
        with fake_mode(fake_cuda=True):
            b = torch.ones(2, device="cuda")
        c = torch.ones(2)
    d = a + c  # outside any mode, ops on fakes give fakes
    assert all(is_fake(t) for t in (a, b, c, d))
    assert not is_fake(torch.ones(2))


def test_mode_is_left_on_exceptions():
    with pytest.raises(ZeroDivisionError):
        with fake_mode():
            1 / 0
    assert not is_fake(torch.ones(1))


def test_mode_is_thread_local():
    seen = {}
    inside = threading.Event()
    done = threading.Event()

    def other_thread():
        inside.wait(5)
        seen["other"] = is_fake(torch.ones(1))
        done.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    with fake_mode():
        inside.set()
        done.wait(5)
        seen["here"] = is_fake(torch.ones(1))
    thread.join(5)
    assert seen == {"other": False, "here": True}


def test_real_tensors_inside_fake_mode_become_fake_inputs():
    real = torch.ones(3)
    with fake_mode():
        out = real * 2
        const = torch.tensor([1.0, 2.0])
    assert is_fake(out) and is_fake(const) and not is_fake(real)


# -- data access -------------------------------------------------------------------


@pytest.mark.parametrize(
    "access, name",
    [
        (lambda t: t.item(), "item()"),
        (lambda t: t.tolist(), "tolist()"),
        (lambda t: t.numpy(), "numpy()"),
        (lambda t: t.data_ptr(), "data_ptr()"),
        (lambda t: bool(t), r"bool\(\)"),
        (lambda t: float(t), r"float\(\)"),
        (lambda t: int(t), r"int\(\)"),
        (lambda t: f"{t:.3f}", "format"),
        (lambda t: torch.equal(t, t), "torch.equal"),
    ],
)
def test_data_access_raises_the_projects_error(access, name):
    with fake_mode():
        t = torch.randn(())  # a random value: not known (see test_constants.py for known ones)
    with pytest.raises(FakeDataAccessError, match=name) as err:
        access(t)
    assert "fake tensor" in str(err.value) and "hold no data" in str(err.value)


@pytest.mark.parametrize("op", [torch.nonzero, torch.unique, lambda t: t[t > 0]])
def test_ops_without_meta_kernel_name_the_operator(op):
    with fake_mode():
        t = torch.ones(4)
        with pytest.raises(UnsupportedOperatorError, match=r"aten\.\w+"):
            op(t)


def test_autograd_on_fake_cuda_does_not_crash_a_cpu_only_process():
    with fake_mode(fake_cuda=True):
        w = torch.nn.Parameter(torch.ones(3, 3, device="cuda"))
    y = (w * 2).sum()
    assert y.requires_grad and y.device == CUDA and y.grad_fn is not None
