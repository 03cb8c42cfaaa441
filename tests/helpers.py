"""Comparisons against eager PyTorch, the reference of every exactness test."""

from __future__ import annotations

import random

import torch

from deferinit import deferred_init
from deferinit.materialize import materialize_module, materialize_tensor


def check_jump_models() -> None:
    """Run the once-per-process checks of the kernels' word counts now
    (deferinit.random.jumps.verified), so that a profiler counting random
    kernels sees only the replay's own."""
    from deferinit.random.jumps import FAMILIES, verified

    for family in FAMILIES:
        verified(family)


def named_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by qualified name (ties listed under every name)."""
    out = dict(module.named_parameters(remove_duplicate=False))
    out.update(module.named_buffers(remove_duplicate=False))
    return out


def assert_same_tensors(eager: torch.nn.Module, deferred: torch.nn.Module) -> None:
    """Every parameter and buffer bit-identical (dtype, shape, values), and the
    same parameter classes, requires_grad flags and ties."""
    a, b = named_tensors(eager), named_tensors(deferred)
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        assert type(x) is type(y), (name, type(x), type(y))
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert x.device.type == y.device.type, name
        assert x.requires_grad == y.requires_grad, name
        assert torch.equal(x.detach().cpu(), y.detach().cpu()), f"{name} differs from eager"
    ids_a = {n: id(t) for n, t in a.items()}
    ids_b = {n: id(t) for n, t in b.items()}
    for n1 in a:
        for n2 in a:
            assert (ids_a[n1] == ids_a[n2]) == (ids_b[n1] == ids_b[n2]), f"tie {n1} / {n2} differs"


def assert_stream(eager_after, d_after, what="the generator after construction") -> None:
    """What a generator draws next equals what it draws after eager construction."""
    assert torch.equal(eager_after, d_after), f"{what} differs from eager"


def build_and_compare(fn, *args, seed=0, mat=None, stream=True, **kwargs):
    """Build eagerly and deferred (materialized with ``mat``) from ``seed``; compare
    the tensors (devices included) and, with ``stream``, what the default
    generator draws next."""
    torch.manual_seed(seed)
    eager = fn(*args, **kwargs)
    eager_after = torch.rand(8)
    torch.manual_seed(seed)
    d = deferred_init(fn, *args, **kwargs)
    materialize_module(d, **(mat or {}))
    d_after = torch.rand(8)
    assert_same_tensors(eager, d)
    for name, t in named_tensors(d).items():
        assert t.device == named_tensors(eager)[name].device, name
    if stream:
        assert_stream(eager_after, d_after)
    return eager, d


def eager_and_deferred(ctor, *args, seed: int = 0, **kwargs):
    """``(eager, deferred)``: the module built eagerly and with deferred_init, same seed."""
    torch.manual_seed(seed)
    eager = ctor(*args, **kwargs)
    torch.manual_seed(seed)
    deferred = deferred_init(ctor, *args, **kwargs)
    return eager, deferred


def materialize_in_order(module: torch.nn.Module, order: str | int = "forward") -> None:
    """Materialize tensor by tensor: "forward", "reverse", or a shuffle seed."""
    items = list(named_tensors(module).values())
    unique = list({id(t): t for t in items}.values())
    if order == "reverse":
        unique.reverse()
    elif order != "forward":
        random.Random(order).shuffle(unique)
    for t in unique:
        assert materialize_tensor(t) is t


def check_exact(ctor, *args, order="module", seed: int = 0, **kwargs):
    """Build eagerly and deferred; materialize (whole module or tensor by tensor in
    ``order``), disturbing the generator in between; assert equality with eager and,
    for whole-module materialization, the same generator state afterwards."""
    torch.manual_seed(seed)
    eager = ctor(*args, **kwargs)
    eager_next = torch.rand(8)
    torch.manual_seed(seed)
    deferred = deferred_init(ctor, *args, **kwargs)
    if order == "module":
        materialize_module(deferred)
        assert torch.equal(torch.rand(8), eager_next), "generator not where eager left it"
    else:
        torch.rand(3)  # the generator moves between deferral and materialization
        materialize_in_order(deferred, order)
    assert_same_tensors(eager, deferred)
    return eager, deferred


def flat_tensor(t: torch.Tensor, path: str = "") -> list:
    """``(path, what)`` for a tensor seen through wrapper subclasses: each wrapper
    as ``(class, flatten context, requires_grad, is a Parameter)``, each plain
    tensor inside as itself."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(t):
        return [(path, t)]
    names, ctx = t.__tensor_flatten__()
    out = [(path, (type(t), repr(ctx), t.requires_grad, isinstance(t, torch.nn.Parameter)))]
    for name in names:
        inner = getattr(t, name)
        if isinstance(inner, torch.Tensor):
            out += flat_tensor(inner, f"{path}.{name}")
    return out


def assert_same_wrapped(eager: torch.nn.Module, deferred: torch.nn.Module) -> None:
    """:func:`assert_same_tensors` through wrapper subclasses and the tensors tensors
    carry (``deferinit.holdings``): every tensor a module holds has eager's
    class, ``Parameter``-ness and ``requires_grad``; every wrapper eager's
    flatten context; every plain tensor inside, eager's dtype, shape, device
    and values; and none is fake.  Ties too: the same names hold the same
    object, and the same plain tensors inside share memory (storage and
    offset), as eagerly."""
    from deferinit import is_deferred
    from deferinit.fake import is_fake
    from deferinit.holdings import module_tensors

    a = {name: t for name, t, _, _ in module_tensors(eager)}
    b = {name: t for name, t, _, _ in module_tensors(deferred)}
    assert a.keys() == b.keys(), set(a) ^ set(b)
    assert not is_deferred(deferred)
    for name in a:
        x, y = a[name], b[name]
        assert type(x) is type(y), (name, type(x), type(y))
        assert isinstance(x, torch.nn.Parameter) == isinstance(y, torch.nn.Parameter), name
        assert x.requires_grad == y.requires_grad, name
        fx, fy = flat_tensor(x, name), flat_tensor(y, name)
        assert [p for p, _ in fx] == [p for p, _ in fy], name
        for (path, u), (_, v) in zip(fx, fy):
            if isinstance(u, tuple):
                assert u == v, (path, u, v)
                continue
            assert not is_fake(v), f"{path} is still fake"
            assert type(u) is type(v), (path, type(u), type(v))
            assert u.dtype == v.dtype and u.shape == v.shape and u.stride() == v.stride(), path
            assert u.device == v.device, path
            assert torch.equal(u.detach(), v.detach()), f"{path} differs from eager"
    _assert_same_partition({n: id(t) for n, t in a.items()}, {n: id(t) for n, t in b.items()}, "tie")

    def memory(module):
        return {path: (u.untyped_storage().data_ptr(), u.storage_offset())
                for name, t in {n: t for n, t, _, _ in module_tensors(module)}.items()
                for path, u in flat_tensor(t, name) if isinstance(u, torch.Tensor) and u.numel()}

    _assert_same_partition(memory(eager), memory(deferred), "shared memory")


def _assert_same_partition(a: dict, b: dict, what: str) -> None:
    """``a`` and ``b`` (name -> key) group the same names together."""
    assert a.keys() == b.keys(), set(a) ^ set(b)
    groups_a, groups_b = {}, {}
    for n in a:
        groups_a.setdefault(a[n], set()).add(n)
        groups_b.setdefault(b[n], set()).add(n)
    for n in a:
        assert groups_a[a[n]] == groups_b[b[n]], f"{what} of {n}: eager {sorted(groups_a[a[n]])}, deferred {sorted(groups_b[b[n]])}"
