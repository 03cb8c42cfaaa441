"""Meta kernels remembered by geometry (fake/metacache.py): a remembered result
has exactly the layout the kernel gives (sizes, strides, offset, dtype, bytes
of storage), also for the kernels whose outputs are not plain contiguous
tensors, and nothing that aliases or depends on data is remembered."""

import pytest
import torch
import torch.nn.functional as F

import deferinit.fake.metacache as metacache
from deferinit.fake import fake_mode


def _programs():
    def transformer_block():
        x = torch.randn(2, 8, 32, requires_grad=True)
        q = x.view(2, 8, 4, 8).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        h = F.layer_norm(a.transpose(1, 2).reshape(2, 8, 32), (32,))
        y = F.gelu(F.linear(h, torch.randn(64, 32)))
        y.sum().backward()
        return [a, h, y, x.grad]

    def conv_and_pooling():
        x = torch.randn(2, 3, 16, 16)
        w = torch.randn(8, 3, 3, 3, requires_grad=True)
        y = F.conv2d(x, w, padding=1)
        p, i = F.max_pool2d(y, 2, return_indices=True)
        p.sum().backward()
        return [y, p, i, w.grad]

    def factories_under_a_default_dtype():
        torch.set_default_dtype(torch.float64)
        try:
            a = torch.zeros(3, 4)
        finally:
            torch.set_default_dtype(torch.float32)
        return [a, torch.zeros(3, 4), torch.ones(3, 4)[:, 1:] * 2]

    def reductions_and_lists():
        x = torch.randn(6, 5)
        return [*torch.split(x * 1, 2), x.max(dim=1).values, torch.stack([x, x]), *torch._foreach_mul([x, x.t()], 2.0)]

    return [transformer_block, conv_and_pooling, factories_under_a_default_dtype, reductions_and_lists]


def _layouts(tensors):
    return [(t.shape, t.stride(), t.storage_offset(), t.dtype, t.untyped_storage().nbytes()) for t in tensors]


@pytest.mark.parametrize("program", _programs(), ids=lambda p: p.__name__)
def test_remembered_results_have_the_kernels_layout(program):
    real = program()
    metacache.ENABLED = False
    try:
        with fake_mode():
            uncached = program()
    finally:
        metacache.ENABLED = True
    with fake_mode():
        first = program()
        again = program()  # from the cache now
    assert _layouts(again) == _layouts(first) == _layouts(uncached) == _layouts(real)


def test_views_writes_and_data_dependent_operators_are_never_remembered():
    aten = torch.ops.aten
    from deferinit.fake.opinfo import op_info

    for op in (aten.view.default, aten.transpose.int, aten.add_.Tensor, aten.lift_fresh.default,
               aten.nonzero.default, aten.resize_.default, aten.detach.default):
        assert not metacache._op_cacheable(op_info(op)), op
    for op in (aten.mm.default, aten.add.Tensor, aten.native_layer_norm.default):
        assert metacache._op_cacheable(op_info(op)), op
