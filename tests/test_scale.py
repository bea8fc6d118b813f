"""In-place gradient scaling by a device scalar (kernels/scale.py) against torch in fp32."""

from __future__ import annotations

import pytest
import torch

from flce_policy.kernels import scale as scale_module
from flce_policy.kernels.ce_kernel import KERNELS_INTERPRETED
from flce_policy.kernels.scale import scale_unless_one_

DEVICE = "cpu" if KERNELS_INTERPRETED else "cuda"
pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(),
    reason="the kernels were compiled (TRITON_INTERPRET unset) and there is no CUDA GPU",
)


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
