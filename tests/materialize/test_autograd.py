"""Tensors computed from parameters keep eager's autograd graph when materialized:
the same ``grad_fn`` chain on the same leaf objects, bit-identical values, and
``backward()`` puts the gradients where eager puts them."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from torch.nn.utils import parametrize

from deferinit import AutogradMaterializationError, deferred_init, is_deferred
from deferinit.fake import is_fake
from helpers import assert_same_tensors, eager_and_deferred, named_tensors
from deferinit.materialize import materialize_module, materialize_tensor


def _graph(t):
    """The autograd graph of ``t`` as nested (name, children) tuples, leaves named by id class."""
    def walk(fn):
        if fn is None:
            return None
        return (fn.name(), tuple(walk(f) for f, _ in fn.next_functions))
    return walk(t.grad_fn)


def _leaf_names(module, t):
    """Qualified names of the module's parameters that ``t``'s graph accumulates into."""
    names = {id(p): n for n, p in module.named_parameters()}
    out, stack, seen = [], [t.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        v = getattr(fn, "variable", None)
        if v is not None:
            out.append(names.get(id(v), "?"))
        stack.extend(f for f, _ in fn.next_functions)
    return sorted(out)


def assert_same_autograd(eager, m, attr):
    e, d = eval(f"eager.{attr}"), eval(f"m.{attr}")
    assert not is_fake(d)
    assert torch.equal(e.detach(), d.detach()), attr
    assert type(e) is type(d)
    assert e.is_leaf == d.is_leaf and e.requires_grad == d.requires_grad, attr
    assert _graph(e) == _graph(d), (attr, _graph(e), _graph(d))
    assert _leaf_names(eager, e) == _leaf_names(m, d), attr
    if e.requires_grad and not e.is_leaf:
        for module in (eager, m):
            module.zero_grad(set_to_none=True)
        weights = torch.arange(e.numel(), dtype=e.dtype).reshape(e.shape)
        (eval(f"eager.{attr}") * weights).sum().backward(retain_graph=True)
        (eval(f"m.{attr}") * weights).sum().backward(retain_graph=True)
        for (name, p), (_, q) in zip(eager.named_parameters(), m.named_parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                assert torch.equal(p.grad, q.grad), name


class Computed(nn.Module):
    """Tensors computed from parameters in the constructor, held every way a module holds them."""

    def __init__(self, how):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4))
        self.b = nn.Parameter(torch.randn(4))
        if how == "buffer":
            self.register_buffer("out", self.w * 2)
        elif how == "non-persistent buffer":
            self.register_buffer("out", self.w.exp(), persistent=False)
        elif how == "attribute":
            self.out = self.w @ self.b
        elif how == "chain of two parameters":
            self.out = (self.w * 2 + self.b).tanh().sum(0)
        elif how == "view of a parameter":
            self.out = self.w[0]
        elif how == "transposed view":
            self.out = self.w.t()
        elif how == "in place on a computed tensor":
            out = self.w * 2
            out.add_(self.b)
            out[1].mul_(3)
            self.out = out
        elif how == "copy into a buffer":
            self.register_buffer("out", torch.zeros(3, 4))
            self.out.copy_(self.w)
        elif how == "computed before init":
            self.out = self.w.sum(1)
            with torch.no_grad():
                self.w.uniform_(-1, 1)
        elif how == "parameter read twice":
            self.out = self.w * self.w
        elif how == "in a list":
            self.out = [self.w * 2, self.b + 1][0]
            self.table = [self.w * 2, self.b + 1]


HOWS = ["buffer", "non-persistent buffer", "attribute", "chain of two parameters", "view of a parameter",
        "transposed view", "in place on a computed tensor", "copy into a buffer", "computed before init",
        "parameter read twice", "in a list"]


@pytest.mark.parametrize("how", HOWS)
def test_computed_tensors_keep_eager_graph(how):
    eager, m = eager_and_deferred(Computed, how)
    materialize_module(m)
    assert_same_tensors(eager, m)
    assert_same_autograd(eager, m, "out")
    if how == "in a list":
        assert_same_autograd(eager, m, "table[1]")


@pytest.mark.parametrize("how", ["buffer", "chain of two parameters", "view of a parameter"])
def test_computed_tensor_materialized_first_brings_its_leaves(how):
    """Materializing the computed tensor alone materializes the parameters its graph reaches."""
    eager, m = eager_and_deferred(Computed, how)
    materialize_tensor(m.out)
    assert not is_deferred(m.w)
    materialize_module(m)
    assert_same_tensors(eager, m)
    assert_same_autograd(eager, m, "out")


def test_parameter_first_then_computed_tensor():
    eager, m = eager_and_deferred(Computed, "chain of two parameters")
    materialize_tensor(m.w)
    materialize_tensor(m.b)
    materialize_tensor(m.out)
    assert_same_autograd(eager, m, "out")


@pytest.mark.parametrize("how", ["view of a parameter", "transposed view", "in a list"])
def test_view_materialized_after_its_parameter(how):
    """The view is taken again from the real parameter: eager's view and graph."""
    eager, m = eager_and_deferred(Computed, how)
    materialize_tensor(m.w)
    materialize_module(m)
    assert_same_tensors(eager, m)
    assert_same_autograd(eager, m, "out")
    if how != "in a list":
        assert m.out._base is m.w


class ViewOfComputed(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4))
        self.x = self.w * 2
        self.y = self.x[0]


def test_view_of_a_computed_tensor_materialized_after_it_is_refused():
    """Its graph would have to start from the computed tensor's real object: named error, nothing changed."""
    m = deferred_init(ViewOfComputed)
    materialize_tensor(m.x)
    y = m.y
    with pytest.raises(AutogradMaterializationError, match="materialize them in one materialize_module call"):
        materialize_module(m)
    assert m.y is y and is_deferred(y)


def test_view_of_a_computed_tensor_together():
    eager, m = eager_and_deferred(ViewOfComputed)
    materialize_tensor(m.y)
    materialize_module(m)
    assert_same_autograd(eager, m, "x")
    assert_same_autograd(eager, m, "y")


def test_buffers_only_refuses_a_buffer_computed_from_a_parameter():
    eager, m = eager_and_deferred(Computed, "buffer")
    with pytest.raises(AutogradMaterializationError, match="buffers_only"):
        materialize_module(m, buffers_only=True)
    assert is_deferred(m.out) and is_deferred(m.w)


@pytest.mark.parametrize("ambient", ["no_grad", "enable_grad"])
def test_ambient_grad_mode_at_deferral(ambient):
    mode = getattr(torch, ambient)
    torch.manual_seed(0)
    with mode():
        eager = Computed("chain of two parameters")
    torch.manual_seed(0)
    with mode():
        m = deferred_init(Computed, "chain of two parameters")
    materialize_module(m)
    assert_same_autograd(eager, m, "out")


class Symmetric(nn.Module):
    def forward(self, x):
        return x.triu() + x.triu(1).transpose(-1, -2)


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.full((1,), 2.0))

    def forward(self, x):
        return x * self.scale


def _parametrized(kind):
    lin = nn.Linear(4, 4)
    if kind == "symmetric":
        parametrize.register_parametrization(lin, "weight", Symmetric())
    elif kind == "two parametrizations":
        parametrize.register_parametrization(lin, "weight", Symmetric())
        parametrize.register_parametrization(lin, "weight", Scaled())
    elif kind == "cached weight":
        parametrize.register_parametrization(lin, "weight", Symmetric())
        lin.held = lin.weight  # the parametrized value, computed through autograd
    return lin


@pytest.mark.parametrize("kind", ["symmetric", "two parametrizations", "cached weight"])
def test_parametrizations(kind):
    eager, m = eager_and_deferred(_parametrized, kind)
    materialize_module(m)
    assert_same_tensors(eager, m)
    assert not is_deferred(m)
    assert_same_autograd(eager, m, "weight")
    if kind == "cached weight":
        assert_same_autograd(eager, m, "held")
    x = torch.randn(2, 4)
    eager.zero_grad(), m.zero_grad()
    eager(x).sum().backward()
    m(x).sum().backward()
    for (n, p), (_, q) in zip(eager.named_parameters(), m.named_parameters()):
        assert torch.equal(p.grad, q.grad), n


@pytest.mark.parametrize("dim", [0, 1, None])
def test_old_style_weight_norm(dim):
    """torch.nn.utils.weight_norm keeps the computed weight as a plain attribute."""
    def make():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return nn.utils.weight_norm(nn.Linear(5, 3), dim=dim)

    eager, m = eager_and_deferred(make)
    materialize_module(m)
    assert_same_tensors(eager, m)
    assert_same_autograd(eager, m, "weight")


def test_parametrization_weight_norm_and_forward_backward():
    make = lambda: nn.utils.parametrizations.weight_norm(nn.Linear(5, 3))
    eager, m = eager_and_deferred(make)
    materialize_module(m)
    assert_same_tensors(eager, m)
    x = torch.randn(2, 5)
    eager(x).square().sum().backward()
    m(x).square().sum().backward()
    for (n, p), (_, q) in zip(eager.named_parameters(), m.named_parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_inference_true_gives_leaves_as_eager_inference_construction():
    """Under inference=True, as under an eager inference_mode() construction, no graph."""
    torch.manual_seed(0)
    with torch.inference_mode():
        eager = Computed("buffer")
    torch.manual_seed(0)
    m = deferred_init(Computed, "buffer")
    materialize_module(m, inference=True)
    for name in ("w", "out"):
        e, d = getattr(eager, name), getattr(m, name)
        assert torch.equal(e, d)
        assert (d.is_leaf, d.requires_grad, d.grad_fn, d.is_inference()) == (e.is_leaf, e.requires_grad, e.grad_fn, True)


def test_outside_leaf_parameter():
    """A parameter from outside the constructor is the very leaf of the computed tensor."""
    shared = nn.Parameter(torch.randn(3))

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("out", shared * 2)

    torch.manual_seed(0)
    eager = M()
    m = deferred_init(M)
    materialize_module(m)
    assert torch.equal(eager.out, m.out)
    assert m.out.grad_fn.next_functions[0][0].variable is shared
    m.out.sum().backward()
    assert torch.equal(shared.grad, torch.full((3,), 2.0))


class NoGradViews(nn.Module):
    """Views taken under no_grad of a parameter (found by the fuzzer)."""

    def __init__(self, how):
        super().__init__()
        t0 = nn.Parameter(torch.empty((2, 2)))
        nn.init.uniform_(t0, -0.5, 0.5)
        if how == "computed from the view":
            with torch.no_grad():
                t1 = t0.view(4)
            self.register_buffer("out", t1.neg())
        elif how == "the view itself":
            with torch.no_grad():
                self.register_buffer("out", t0[0])
        elif how == "the view and its parameter":
            self.p = t0
            with torch.no_grad():
                self.out = t0.t()
        elif how == "set_ from a parameter":
            t2 = torch.ones(())
            t2.set_(t0)
            self.register_buffer("out", t2)


@pytest.mark.parametrize("how", ["computed from the view", "the view itself", "the view and its parameter", "set_ from a parameter"])
def test_views_taken_under_no_grad(how):
    eager, m = eager_and_deferred(NoGradViews, how)
    materialize_module(m)
    assert_same_tensors(eager, m)
    e, d = eager.out, m.out
    assert torch.equal(e.detach(), d.detach())
    assert (e.requires_grad, e.is_leaf, e._is_view(), _graph(e)) == (d.requires_grad, d.is_leaf, d._is_view(), _graph(d))
    if how == "the view and its parameter":
        assert d._base is m.p


class WritesBehindNoGradViews(nn.Module):
    """Writes to the memory of a view taken under no_grad, through an object
    with a version counter of its own (``.data``): eagerly the view's
    ``grad_fn`` stays readable (found by the fuzzer)."""

    def __init__(self, how):
        super().__init__()
        t0 = torch.zeros(2, 2)
        p = nn.Parameter(t0)
        with torch.no_grad():
            v = p.view(4)
        self.p = p
        if how == "through the view's data":
            v.data.fill_(1.0)
        elif how == "through the tensor the parameter was made from":
            t0.data.clamp_(0.0, 0.0)
        elif how == "view of the view":
            with torch.no_grad():
                v = v[1:]
            p.data.add_(1.0)
        elif how == "computed from the view afterwards":
            v.data.fill_(2.0)
            v = v.neg()
        elif how == "parameter's data replaced by a smaller tensor":
            v.data.fill_(1.0)
            p.data = torch.ones(1)
        elif how == "written under no_grad (eagerly raises too)":
            with torch.no_grad():
                p.add_(1.0)
        self.register_buffer("out", v)


def _autograd_facts(t):
    try:
        graph = _graph(t)
    except RuntimeError as e:
        return ("raises", str(e)[:40])
    return (t.requires_grad, t.is_leaf, t._is_view(), graph)


@pytest.mark.parametrize("how", [
    "through the view's data", "through the tensor the parameter was made from", "view of the view",
    "computed from the view afterwards", "parameter's data replaced by a smaller tensor",
    "written under no_grad (eagerly raises too)"])
@pytest.mark.parametrize("order", ["module", "tensors"])
def test_writes_behind_no_grad_views(how, order):
    eager, m = eager_and_deferred(WritesBehindNoGradViews, how)
    if order == "module":
        materialize_module(m)
    else:
        materialize_tensor(m.out)
        materialize_tensor(m.p)
    assert_same_tensors(eager, m)
    assert torch.equal(eager.out.detach(), m.out.detach())
    assert _autograd_facts(eager.out) == _autograd_facts(m.out)
    if m.out._is_view():
        assert m.out._base is m.p
    shared = [x.out.untyped_storage()._cdata == x.p.untyped_storage()._cdata for x in (eager, m)]
    assert shared[0] == shared[1]


def test_data_write_into_no_grad_view_after_construction():
    """The fuzzer's case: the write comes after deferred_init returned."""
    eager, m = eager_and_deferred(WritesBehindNoGradViews, "none")
    eager.out.data.fill_(0.5)
    m.out.data.fill_(0.5)
    materialize_module(m)
    assert torch.equal(eager.out, m.out.detach())
    assert _autograd_facts(eager.out) == _autograd_facts(m.out)


class GradWriteAfterNoGradReshape(nn.Module):
    """An in-place op under grad mode on a tensor whose geometry an in-place op
    under no_grad changed before (found by the fuzzer): eagerly allowed."""

    def __init__(self, how):
        super().__init__()
        p = nn.Parameter(torch.zeros(1, 2))
        if how == "parameter with replaced data":
            p.data = torch.randn(1, 2)
            with torch.no_grad():
                p.t_()
                v = p.squeeze()
            p.data.copy_(p)
            self.register_buffer("v", v)
            self.p = p
        else:
            x = torch.zeros(4)
            v = x[1:3]
            if how == "view of a plain tensor, old geometry kept":
                self.register_buffer("w", v.detach())
            with torch.no_grad():
                v.unsqueeze_(0)
            v.copy_(p)
            self.register_buffer("x", x)
            self.register_buffer("v", v)
            self.p = p


@pytest.mark.parametrize("how", [
    "parameter with replaced data", "view of a plain tensor", "view of a plain tensor, old geometry kept"])
@pytest.mark.parametrize("order", ["module", "tensors"])
def test_grad_write_after_no_grad_reshape(how, order):
    eager, m = eager_and_deferred(GradWriteAfterNoGradReshape, how)
    if order == "module":
        materialize_module(m)
    else:
        for t in reversed(list(m.buffers())):
            materialize_tensor(t)
        materialize_tensor(m.p)
    assert_same_tensors(eager, m)
    for name, e in named_tensors(eager).items():
        assert _autograd_facts(e) == _autograd_facts(named_tensors(m)[name]), name


class MyParameter(nn.Parameter):
    pass


class ParameterWrittenWithGrad(nn.Module):
    """A parameter that does not require grad, written in place under grad mode
    from one that does: eagerly still the same Parameter object, now with a
    ``grad_fn`` (found by the fuzzer)."""

    def __init__(self, how):
        super().__init__()
        self.src = nn.Parameter(torch.randn(3))
        cls = MyParameter if how == "a Parameter subclass" else nn.Parameter
        self.dst = cls(torch.zeros(3), requires_grad=False)
        if how in ("copy_", "a Parameter subclass"):
            self.dst.copy_(self.src)
        elif how == "add_":
            self.dst.add_(self.src * 2)


@pytest.mark.parametrize("how", ["copy_", "add_", "a Parameter subclass", "set_ after construction"])
@pytest.mark.parametrize("order", ["module", "tensors"])
def test_parameter_written_with_grad_stays_a_parameter(how, order):
    eager, m = eager_and_deferred(ParameterWrittenWithGrad, how)
    if how == "set_ after construction":
        eager.dst.set_(eager.src)
        m.dst.set_(m.src)
    if order == "module":
        materialize_module(m)
    else:
        materialize_tensor(m.dst)
        materialize_tensor(m.src)
    assert_same_tensors(eager, m)
    if how == "set_ after construction":
        # set_ has no derivative (NotImplemented): backward raises, eagerly too.
        assert _autograd_facts(eager.dst) == _autograd_facts(m.dst)
    else:
        assert_same_autograd(eager, m, "dst")


class SetFromParameter(nn.Module):
    """A buffer that ``set_`` made share a parameter's memory under grad mode
    (eagerly a NotImplemented grad_fn reaching the parameter), materialized
    after the parameter (found by the fuzzer)."""

    def __init__(self, how):
        super().__init__()
        self.p = nn.Parameter(torch.randn(2, 3))
        b = torch.zeros(())
        b.div_(3.25)
        if how == "whole tensor":
            b.set_(self.p)
        elif how == "a parameter of its own":
            b.set_(nn.Parameter(torch.ones(2)))
        elif how == "set_ of a view":
            with torch.no_grad():
                v = self.p[1]
            b.set_(v)
        self.register_buffer("b", b)


@pytest.mark.parametrize("how", ["whole tensor", "a parameter of its own", "set_ of a view"])
@pytest.mark.parametrize("order", ["parameter first", "buffer first", "module"])
def test_set_from_a_parameter_materialized_before(how, order):
    eager, m = eager_and_deferred(SetFromParameter, how)
    if order == "parameter first":
        materialize_tensor(m.p)
        materialize_module(m)
    elif order == "buffer first":
        materialize_tensor(m.b)
        materialize_tensor(m.p)
    else:
        materialize_module(m)
    assert_same_tensors(eager, m)
    assert _autograd_facts(eager.b) == _autograd_facts(m.b)
    if how != "a parameter of its own":
        assert m.b.untyped_storage().data_ptr() == m.p.untyped_storage().data_ptr()
    if how == "whole tensor":
        assert m.b.grad_fn.next_functions[-1][0].variable is m.p
class ReadThenWritten(nn.Module):
    """A parameter read by autograd, viewed under no_grad, then written in place;
    ``alias`` shares its storage (another object, not requiring grad)."""

    def __init__(self, view):
        super().__init__()
        self.p = nn.Parameter(torch.empty((2, 3)))
        nn.init.uniform_(self.p, -0.5, 0.5)
        self.register_buffer("old", self.p.clone())
        with torch.no_grad():
            self.register_buffer("v", eval(f"self.p{view}"))
            self.p.copy_(torch.arange(6.0).reshape(2, 3))
        self.alias = nn.Parameter(self.p, requires_grad=False)


@pytest.mark.parametrize("first", ["p", "alias"])
@pytest.mark.parametrize("view", [".as_strided((3,), (0,), 0)", "[1]", ".t()", ".view(6)"])
def test_view_of_parameter_after_an_older_read(view, first):
    """The parameter's storage is real before the module is materialized; its
    older value is computed afresh for the clone, and the view is taken again
    from the real memory (current values, the parameter as _base), as eagerly."""
    eager, m = eager_and_deferred(ReadThenWritten, view)
    materialize_tensor(getattr(m, first))
    materialize_module(m)
    assert_same_tensors(eager, m)
    assert torch.equal(eager.v, m.v) and torch.equal(eager.old, m.old)
    assert m.v._base is m.p
    assert m.v.untyped_storage().data_ptr() == m.alias.untyped_storage().data_ptr()
    assert _graph(eager.old) == _graph(m.old)
    if first == "alias":
        assert_same_autograd(eager, m, "old")


def test_graph_from_an_older_value_of_a_parameter_materialized_before():
    """The parameter is real, its older value computed afresh: the real parameter
    holds that value for the call that reads it (as eagerly it held it then),
    so the graph accumulates into the parameter itself."""
    eager, m = eager_and_deferred(ReadThenWritten, "[1]")
    materialize_tensor(m.p)
    p = m.p.detach().clone()
    materialize_module(m)
    assert _leaf_names(eager, eager.old) == _leaf_names(m, m.old) == ["p"]
    assert_same_tensors(eager, m)
    assert torch.equal(m.p, p)  # its memory given back


class GraphKeptAcrossData(nn.Module):
    """Autograd state that changes after a tensor is computed or viewed: ``.data =``
    on a tensor with a graph, ``requires_grad_`` on the base of a view, a view
    whose base is written later (found by the fuzzer's long profile)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 3))
        y = self.w * 3
        y.data = torch.randn(2, 3)  # keeps MulBackward0 with other memory
        self.register_buffer("y", y)
        self.register_buffer("z", y.exp())  # computed after: through y's graph
        base = torch.randn(2, 3)
        row = base[1]
        base.requires_grad_()
        self.register_buffer("row2", row * 2)  # MulBackward0 -> nothing: row follows base
        self.v = nn.Parameter(torch.randn(4))
        head = self.v[:2]
        with torch.no_grad():
            self.v.mul_(2)
        self.register_buffer("head", head)  # regenerated: AsStridedBackward0


@pytest.mark.parametrize("order", ["module", "forward", "reverse"])
def test_graph_kept_across_data_and_requires_grad(order):
    """Each tensor has eager's values, graph and leaves, and backward puts eager's
    gradients on the parameters, whatever the order of materialization."""
    eager, m = eager_and_deferred(GraphKeptAcrossData)
    if order == "module":
        materialize_module(m)
    else:
        from helpers import materialize_in_order

        materialize_in_order(m, order)
    assert_same_tensors(eager, m)
    for attr in ("y", "z", "row2", "head"):
        assert_same_autograd(eager, m, attr)
