"""In-place gradient scaling by a device scalar (kernels/scale.py) against torch in fp32."""

from __future__ import annotations

import pytest
import torch
from test_loss_kernel import DEVICE, NEEDS_KERNEL_DEVICE

from flce_policy.kernels import scale as scale_module
from flce_policy.kernels.scale import scale_all_unless_one_, scale_unless_one_

pytestmark = NEEDS_KERNEL_DEVICE


@pytest.fixture
def small_blocks(monkeypatch):
    # 16-element blocks and at most 3 programs: 7 blocks and a tail make every program loop
    monkeypatch.setattr(scale_module, "_BLOCK", 16)
    monkeypatch.setattr(scale_module, "_MAX_PROGRAMS", 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("factor", [2.5, -0.75, 1e-3])
def test_every_element_is_scaled_once_with_an_fp32_product(small_blocks, dtype, factor):
    values = torch.randn(7 * 16 + 5, device=DEVICE).to(dtype)
    exact = values.double() * factor
    got = scale_unless_one_(values.clone(), torch.tensor(factor, device=DEVICE))
    assert got.dtype == dtype
    if dtype == torch.float32:
        assert torch.equal(got, values * torch.tensor(factor))
    else:
        # one bf16 rounding of the fp32 product: within one unit in the last place (the
        # interpreter truncates, the GPU rounds to nearest)
        assert ((got.double() - exact).abs() <= exact.abs() * 2.0**-7).all()


def test_a_scale_of_one_leaves_the_tensor_untouched(small_blocks):
    values = torch.randn(40, 3, device=DEVICE).to(torch.bfloat16)
    before = values.clone()
    assert scale_unless_one_(values, torch.ones((), device=DEVICE)) is values
    assert torch.equal(values, before)


def test_an_empty_tensor_and_bad_arguments():
    assert scale_unless_one_(torch.empty(0, device=DEVICE), torch.tensor(3.0, device=DEVICE)).numel() == 0
    with pytest.raises(ValueError, match="contiguous"):
        scale_unless_one_(torch.zeros(4, 4, device=DEVICE).t(), torch.tensor(2.0, device=DEVICE))
    with pytest.raises(ValueError, match="one element"):
        scale_unless_one_(torch.zeros(4, device=DEVICE), torch.ones(2, device=DEVICE))


@pytest.mark.parametrize("factor", [2.5, 1.0])
def test_one_launch_scales_each_tensor_of_a_call(small_blocks, factor):
    """Gradients of different sizes and dtypes (an empty one too): each element scaled once, none when 1."""
    g = torch.Generator().manual_seed(3)
    sizes_dtypes = [(7 * 16 + 5, torch.bfloat16), (3 * 16, torch.float32), (0, torch.bfloat16)]
    tensors = [torch.randn(n, generator=g).to(dtype).to(DEVICE) for n, dtype in sizes_dtypes]
    before = [t.clone() for t in tensors]
    out = scale_all_unless_one_(tensors, torch.tensor(factor, device=DEVICE))
    assert all(o is t for o, t in zip(out, tensors, strict=True))
    for got, was in zip(tensors, before, strict=True):
        exact = was.double() * factor
        assert ((got.double() - exact).abs() <= exact.abs() * 2.0**-7).all()
        if factor == 1.0 or got.dtype == torch.float32:
            assert torch.equal(got, (was.float() * factor).to(got.dtype))


def test_more_tensors_than_one_launch_takes_is_refused():
    four = [torch.zeros(2, device=DEVICE) for _ in range(4)]
    with pytest.raises(ValueError, match="at most 3 tensors, got 4"):
        scale_all_unless_one_(four, torch.tensor(2.0, device=DEVICE))
