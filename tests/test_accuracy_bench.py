"""The accuracy benchmark's pieces on the CPU: a method's errors against the fp32 reference, the skipped share."""

from __future__ import annotations

import torch

from flce_policy.benchmarks.accuracy import method_errors, skipped_share
from flce_policy.benchmarks.methods import Inputs, Method, Unavailable
from flce_policy.benchmarks.reference import chunked_fp32_reference


def _inputs(tokens=64, hidden=16, vocab=300, scale=1.0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w = (torch.randn(vocab, hidden, generator=gen) * scale / hidden**0.5).to(dtype)
    y = torch.randint(0, vocab, (tokens,), generator=gen)
    return Inputs(x, w, y)


def _eager(inputs: Inputs):
    return lambda x, w: torch.nn.functional.cross_entropy((x.float() @ w.float().t()), inputs.target)


def test_an_exact_method_has_no_error_and_a_perturbed_one_has_its_error():
    inputs = _inputs()
    reference = chunked_fp32_reference(inputs.x, inputs.weight, inputs.target, rows=16)
    exact = method_errors(Method("fp32", "test", _eager), inputs, reference)
    assert exact.status == "ok" and exact.loss_error < 1e-5
    assert exact.grad_input_error < 1e-5 and exact.grad_weight_error < 1e-5

    def doubled(inputs):  # twice the loss: every gradient off by 100%
        return lambda x, w: 2 * _eager(inputs)(x, w)

    off = method_errors(Method("2x", "test", doubled), inputs, reference)
    assert abs(off.grad_input_error - 1.0) < 1e-4 and abs(off.grad_weight_error - 1.0) < 1e-4
    assert abs(off.loss_error - float(reference[0])) < 1e-4


def test_the_softcapped_reference_is_autograd_of_the_capped_logits():
    inputs = _inputs(scale=40.0)  # logits of std ~40: the cap of 5 bends most of them
    x, w = inputs.x.clone().requires_grad_(), inputs.weight.clone().requires_grad_()
    z = x @ w.t()
    loss = torch.nn.functional.cross_entropy(5.0 * torch.tanh(z / 5.0), inputs.target)
    expected = (loss, *torch.autograd.grad(loss, (x, w)))
    got = chunked_fp32_reference(inputs.x, inputs.weight, inputs.target, rows=16, softcap=5.0)
    for a, b in zip(got, expected, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    uncapped = chunked_fp32_reference(inputs.x, inputs.weight, inputs.target, rows=16)
    assert not torch.allclose(uncapped[1], expected[1], rtol=1e-2)


def test_an_unavailable_method_says_why():
    def missing(_inputs):
        raise Unavailable("not installed")

    inputs = _inputs()
    record = method_errors(
        Method("peer", "test", missing), inputs, chunked_fp32_reference(inputs.x, inputs.weight, inputs.target)
    )
    assert record.status == "not installed" and record.grad_input_error is None


def test_skipped_share_counts_the_filter_tiles():
    # near-uniform logits over 300 classes: every |p| ~ 1/300 > 2^-12, nothing skippable
    flat = _inputs(scale=0.01)
    assert skipped_share(flat, 2.0**-12) == 0.0
    # eps above every probability but a target's |p - 1|: every tile without a target is skippable
    peaked = _inputs(tokens=64, vocab=1024, scale=0.01)
    share = skipped_share(peaked, 0.5)
    tiles_with_target = len({int(t) // 128 for t in peaked.target})
    assert share == (8 - tiles_with_target) / 8
