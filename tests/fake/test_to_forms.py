"""``Tensor.to`` on fakes accepts what eager ``Tensor.to`` accepts (issue 11, the
``.to()`` family and item 20): every signature, positional ``None`` dtypes,
``copy``, ``memory_format``, another tensor, device indices, and the Python
types ``bool``/``int``/``float``/``complex`` as dtypes; and refuses what eager
refuses, with eager's exception and message.

The reference is eager ``Tensor.to`` on a real CPU tensor; CUDA forms are
compared with the same call where CUDA is CPU (only the device differs)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from deferinit.fake import fake_mode, is_fake
from deferinit.fake.function import parse_to

CPU = torch.device("cpu")

# Values for each slot of Tensor.to's three signatures, valid or not.
CPU_VALUES = [
    None, "cpu", torch.device("cpu"), b"cpu", torch.float16, torch.float64, torch.int32,
    float, int, bool, complex, True, False, 1.0, torch.channels_last, np.float32, "nodevice",
]
KEYWORDS = {
    "device": [None, "cpu", CPU, torch.float16],
    "dtype": [None, torch.float64, float, int, "cpu"],
    "non_blocking": [True, False, None],
    "copy": [True, False, None],
    "memory_format": [None, torch.channels_last, torch.contiguous_format, torch.preserve_format],
    "tensor": ["real64"],
}


def _real64():
    return torch.zeros(1, dtype=torch.float64)


def _materialize_value(v):
    return _real64() if v == "real64" else v


def _forms(rng: random.Random, n: int):
    forms = []
    for _ in range(n):
        args = tuple(rng.choice(CPU_VALUES + ["real64"]) for _ in range(rng.randint(0, 4)))
        keys = rng.sample(sorted(KEYWORDS), rng.randint(0, 2))
        kwargs = {k: rng.choice(KEYWORDS[k]) for k in keys}
        forms.append((args, kwargs))
    return forms


CURATED = [
    (("cpu",), {}), ((CPU,), {}), ((), {"device": "cpu"}), ((None, None, False), {}),
    (("cpu", None, False), {}), (("cpu", None), {}), ((None, torch.float16, False), {}),
    ((torch.float16, False, True), {}), (("cpu", torch.float16, False, True), {}),
    ((CPU, torch.float64, True, True), {}), ((), {"dtype": torch.float64, "copy": True}),
    (("cpu",), {"non_blocking": True}), (("real64",), {}), (("real64", False, True), {}),
    ((), {"tensor": "real64"}), ((), {"tensor": "real64", "copy": True}),
    ((), {"memory_format": torch.channels_last}), (("cpu",), {"memory_format": torch.channels_last}),
    ((float,), {}), ((int,), {}), ((bool,), {}), ((complex,), {}), ((), {"dtype": float}),
    (("cpu", int), {}), ((float, False, True), {}), ((True,), {}), ((1.0,), {}),
    ((), {"copy": True}), ((), {"copy": False}), ((None,), {"non_blocking": None}),
    ((torch.float16, 1), {}), (("cpu",), {"device": "cpu"}), (("real64",), {"dtype": torch.float16}),
    ((), {"device": "cpu", "foo": 1}), (("cpu", torch.half, False, True, None), {}),
]


def _eager_or_error(t, args, kwargs):
    try:
        return t.to(*args, **kwargs), None
    except Exception as e:  # noqa: BLE001 - the exception is what is compared
        return None, e


def _compare(eager_in, eager_out, eager_err, fake_in, fake_out, fake_err, form, device=CPU):
    if eager_err is not None:
        assert fake_err is not None, f"{form}: eager raised {eager_err!r}, the fake accepted it"
        assert type(fake_err) is type(eager_err), f"{form}: {fake_err!r} instead of {eager_err!r}"
        assert str(fake_err) == str(eager_err), form
        return
    assert fake_err is None, f"{form}: eager accepted it, the fake raised {fake_err!r}"
    assert is_fake(fake_out), form
    assert fake_out.device == (eager_out.device if device == CPU else device), form
    assert fake_out.dtype == eager_out.dtype, form
    assert fake_out.shape == eager_out.shape and fake_out.stride() == eager_out.stride(), form
    assert (fake_out is fake_in) == (eager_out is eager_in), f"{form}: copy semantics differ"


@pytest.mark.parametrize("seed", range(4))
def test_fake_to_matches_eager_on_cpu_forms(seed):
    """Curated forms and random ones (fixed seeds): same result or same error as eager."""
    forms = CURATED + _forms(random.Random(seed), 150)
    real = torch.rand(2, 3, 4, 5)
    with fake_mode():
        fake = torch.rand(2, 3, 4, 5)
    for args, kwargs in forms:
        a = tuple(_materialize_value(v) for v in args)
        k = {n: _materialize_value(v) for n, v in kwargs.items()}
        eager_out, eager_err = _eager_or_error(real, a, k)
        fake_out, fake_err = _eager_or_error(fake, a, k)
        _compare(real, eager_out, eager_err, fake, fake_out, fake_err, (args, kwargs))


def _cuda_to_cpu(x):
    if isinstance(x, str) and x.startswith("cuda"):
        return "cpu"
    if isinstance(x, torch.device) and x.type == "cuda":
        return CPU
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return CPU
    return x


CUDA_FORMS = [
    (("cuda",), {}), (("cuda:1",), {}), ((torch.device("cuda"),), {}), ((0,), {}), ((1, torch.float16), {}),
    ((np.int64(1),), {}), ((), {"device": 1}), ((), {"device": "cuda", "dtype": float}),
    (("cuda", None, False), {}), (("cuda", torch.float16, False, True), {}),
    ((torch.device("cuda", 1), torch.float64, False, True), {}), (("cuda",), {"copy": True}),
    (("cuda",), {"memory_format": torch.channels_last}), (("cuda", int), {}),
]


@pytest.mark.parametrize("form", CUDA_FORMS, ids=str)
def test_fake_to_cuda_forms(form):
    """CUDA targets (names, devices, indices) on a fake: the fake reports the
    device; dtype and layout are eager's for the same call on CPU."""
    args, kwargs = form
    real = torch.rand(2, 3, 4, 5)
    eager_out = real.to(*map(_cuda_to_cpu, args), **{k: _cuda_to_cpu(v) for k, v in kwargs.items()})
    index = next((torch.device(x).index if not isinstance(x, (int, np.integer)) else int(x)
                  for x in list(args) + list(kwargs.values())
                  if isinstance(x, (str, torch.device, int, np.integer)) and not isinstance(x, bool)), None)
    with fake_mode(fake_cuda=True):
        fake = torch.rand(2, 3, 4, 5)
        out = fake.to(*args, **kwargs)
    assert out.device == torch.device("cuda", index or 0)
    assert out.dtype == eager_out.dtype and out.stride() == eager_out.stride()


def test_fake_to_other_fake_tensor_takes_its_reported_device():
    with fake_mode(fake_cuda=True):
        t = torch.ones(2, 3)
        other = torch.ones(1, dtype=torch.float64, device="cuda")
        for out in (t.to(other), t.to(other, non_blocking=True), t.to(tensor=other), t.to(other, False, True)):
            assert is_fake(out) and out.device == other.device and out.dtype == torch.float64


def test_device_index_without_faked_cuda_fails_as_eager():
    """Without fake_cuda, a device index on a CPU-only build fails as eager fails."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA build takes device indices")
    real = torch.ones(2)
    with pytest.raises(RuntimeError) as eager:
        real.to(0)
    with fake_mode():
        with pytest.raises(RuntimeError) as faked:
            real.to(0)
    assert str(faked.value) == str(eager.value)


@pytest.mark.parametrize("args, kwargs", [(a, k) for a, k in CURATED if "real64" not in a + tuple(k.values())])
def test_parse_to_agrees_with_pytorch_parser(args, kwargs):
    """Where PyTorch's own parser (the one nn.Module.to uses) answers, parse_to
    answers the same; copy comes back separately."""
    expected_copy = kwargs.get("copy", False)
    stripped = dict(kwargs)
    stripped.pop("copy", None)
    positional_copy = len(args) == 4 or (len(args) == 3 and not isinstance(args[0], (str, torch.device, type(None))))
    a = args[:-1] if positional_copy else args
    try:
        expected = torch._C._nn._parse_to(*a, **stripped)
    except Exception as e:  # noqa: BLE001
        with pytest.raises(type(e)):
            parse_to(args, kwargs)
        return
    device, dtype, rest = parse_to(args, kwargs)
    assert (device, dtype, rest["non_blocking"], rest["memory_format"]) == expected
    assert rest["copy"] == (args[-1] if positional_copy else expected_copy)
