"""GPU suite (marker ``gpu``): the loss under ``torch.compile`` with inductor and with CUDA graphs.

The CPU side (``test_compile.py``) runs ``aot_eager`` under the Triton interpreter; here the
compiled kernels run, inductor compiles the graph around the custom op, and
``mode="reduce-overhead"`` captures fwd and bwd into CUDA graphs. Compiled results are compared
with eager on the same inputs; the kernels and geometry are the same, so they agree to rounding.
"""

from __future__ import annotations

import pytest
import torch
from _compiled_gpu import fresh_dynamo, replayed  # noqa: F401 (fresh_dynamo: an autouse fixture)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPE = (4096, 1024, 32768)


def _inputs(tokens=SHAPE[0], hidden=SHAPE[1], vocab=SHAPE[2], seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, device="cuda", generator=g, dtype=torch.bfloat16)
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) * (4.0 / hidden**0.5)).to(torch.bfloat16)
    y = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    y[torch.rand(tokens, device="cuda", generator=g) < 0.1] = -100
    return x, w, y


def _loss(x, w, y):
    from flce_policy import fused_linear_cross_entropy

    return fused_linear_cross_entropy(x, w, y, softcap=30.0, z_loss_scale=1e-4, label_smoothing=0.05)


def _step(fn, x, w, y, grad_output=1.0):
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(xr, wr, y)
    (loss * grad_output).backward()
    return loss.detach().clone(), xr.grad, wr.grad


def _assert_same(got, want):
    for g, e in zip(got, want, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape
        torch.testing.assert_close(g.float(), e.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("grad_output", [1.0, 0.5])
def test_inductor_fullgraph_equals_eager(grad_output):
    x, w, y = _inputs()
    compiled = torch.compile(_loss, fullgraph=True)
    want = _step(_loss, x, w, y, grad_output)
    for _ in range(2):
        _assert_same(_step(compiled, x, w, y, grad_output), want)


@pytest.mark.parametrize("forward", ["eager", "compiled"])
def test_compiled_autograd_equals_eager(forward):
    """compiled autograd (inductor) traces the backward: the op's, or the eager autograd.Function's Triton scale."""
    from torch._dynamo.utils import counters

    x, w, y = _inputs(1024, 512, 8192)
    scale = torch.tensor(0.5, device="cuda")  # not 1: the scale pass must run
    want = _step(_loss, x, w, y, scale)

    def train_step(xr, wr):
        loss = (_loss if forward == "eager" else torch.compile(_loss, fullgraph=True))(xr, wr, y)
        loss.backward(scale)
        return loss.detach()

    counters["compiled_autograd"].clear()
    with torch._dynamo.compiled_autograd._enable(torch.compile(fullgraph=True)):
        for _ in range(2):
            xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
            _assert_same((train_step(xr, wr), xr.grad, wr.grad), (want[0], want[1], want[2]))
    assert counters["compiled_autograd"]["captures"] >= 1


def test_inductor_scales_the_gradients_in_place_and_peaks_no_higher(monkeypatch):
    """.grad is the buffer the driver allocated, compiled as in eager, so the compiled step's peak is eager's."""
    import flce_policy.call.autograd as flce_autograd

    seen = []
    run = flce_autograd.run_with_oom_fallback

    def spy(*args, **kwargs):
        out, geometry = run(*args, **kwargs)
        seen.append((out.grad_input.data_ptr(), out.grad_weight.data_ptr()))
        return out, geometry

    monkeypatch.setattr(flce_autograd, "run_with_oom_fallback", spy)
    x, w, y = _inputs(2048, 512, 16384)
    compiled = torch.compile(_loss, fullgraph=True)
    peaks = {}
    # each form's second call counts: after compiling, and after the first call's one-off allocations
    for name, fn in (("eager", _loss), ("eager", _loss), ("compiled", compiled), ("compiled", compiled)):
        xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        (fn(xr, wr, y) * 2.0).backward()
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
        assert seen[-1] == (xr.grad.data_ptr(), wr.grad.data_ptr()), name
    assert peaks["compiled"] <= peaks["eager"], peaks


def test_inductor_no_graph_break():
    x, w, y = _inputs(512, 256, 4096)
    explanation = torch._dynamo.explain(_loss)(x.requires_grad_(), w.requires_grad_(), y)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_reduce_overhead_equals_eager_without_a_host_sync():
    from torch._dynamo.utils import counters

    x, w, y = _inputs()
    want = _step(_loss, x, w, y)
    compiled = torch.compile(_loss, fullgraph=True, mode="reduce-overhead")
    counters.clear()
    for got in replayed(lambda: _step(compiled, x, w, y)):
        _assert_same(got, want)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


def test_reduce_overhead_bad_target_replays_as_nan():
    x, w, y = _inputs(1024, 512, 8192)
    compiled = torch.compile(_loss, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):  # captured with good targets
        torch.compiler.cudagraph_mark_step_begin()
        loss, _, gw = _step(compiled, x, w, y)
        assert torch.isfinite(loss) and torch.isfinite(gw).all()
    bad = y.clone()
    bad[5] = w.shape[0] + 3
    torch.compiler.cudagraph_mark_step_begin()
    loss, gx, gw = _step(compiled, x, w, bad)
    assert torch.isnan(loss) and torch.isnan(gw).all()


def test_compiled_hf_training_step_equals_eager():
    transformers = pytest.importorskip("transformers")
    integration = pytest.importorskip("flce_policy.integrations.transformers")
    apply_flce = getattr(integration, "apply_flce", None)
    if apply_flce is None:
        pytest.skip("flce_policy.integrations.transformers has no apply_flce")
    config = transformers.LlamaConfig(
        vocab_size=32768, hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=8, max_position_embeddings=1024,
    )  # fmt: skip
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (4, 512), device="cuda")
    labels = ids.clone()
    labels[:, :16] = -100

    def run(compile_it):
        model = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16)
        model.load_state_dict(base.state_dict())
        apply_flce(model)
        model.train()

        def step(ids, labels):
            return model(input_ids=ids, labels=labels).loss

        fn = torch.compile(step, fullgraph=True) if compile_it else step
        loss = fn(ids, labels)
        loss.backward()
        return loss.detach(), model.lm_head.weight.grad, model.model.embed_tokens.weight.grad

    want, got = run(False), run(True)
    torch.testing.assert_close(got[0], want[0], rtol=2e-2, atol=2e-2)  # the body is re-fused by inductor
    for g, e in zip(got[1:], want[1:], strict=True):
        assert (g.float() - e.float()).norm() <= 0.05 * e.float().norm()
