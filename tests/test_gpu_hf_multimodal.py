"""GPU (marker ``gpu``): apply_flce on Gemma 4 and PaliGemma 2's multimodal classes at bf16, against HF's own loss.

Tiny-but-real models: a Gemma-4 text config (``final_logit_softcapping`` = 30, hidden 384, vocab
8192) in ``Gemma4ForConditionalGeneration``, and PaliGemma with a Gemma-2 text config (its
real softcap 30) and a small SigLIP tower, fed an image. The head is scaled up so the logits reach
tens and the softcap bends them. Three runs from the same weights: HF's loss in fp32 (the
reference), HF's loss in bf16, and apply_flce in bf16, in ``eval()`` mode with autograd recording
(the fused path runs whatever the mode).

Tolerance: bf16 is what both bf16 paths round to, so apply_flce's distance from the fp32 reference
may be at most twice HF's own bf16 distance, or one bf16 ulp (2**-8 relative) when HF's happens
to be smaller than that; the loss and the head gradient (max-norm relative) are checked.
Skipped where the installed transformers lacks a class (carry a newer wheel: docs/integrations.md).
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flce_policy.integrations.transformers import apply_flce  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HIDDEN, VOCAB, SEQ, ROWS = 384, 8192, 256, 2
HEAD_GAIN = 40.0  # logits of tens: the softcap of 30 changes them
BF16_ULP = 2.0**-8


def _need(name: str):
    cls = getattr(transformers, name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    return cls


def _text(**extra):
    return dict(
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=VOCAB,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
        **extra,
    )


def gemma4():
    cls = _need("Gemma4ForConditionalGeneration")
    # softcap 30 set explicitly: Gemma4TextConfig defaults to None; Gemma checkpoints' configs carry 30
    text = _text(vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=64, final_logit_softcapping=30.0)
    config = transformers.Gemma4Config(text_config={**text, "model_type": "gemma4_text"})
    ids = torch.randint(3, VOCAB, (ROWS, SEQ))
    return cls, config, {"input_ids": ids}, ids.clone()


def paligemma2():
    cls = _need("PaliGemmaForConditionalGeneration")
    image_token = VOCAB - 1
    vision = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4)
    config = transformers.PaliGemmaConfig(
        text_config=_text(model_type="gemma2"),
        vision_config={**vision, "image_size": 56, "patch_size": 14},
        projection_dim=HIDDEN,
        hidden_size=HIDDEN,
        image_token_index=image_token,
        vocab_size=VOCAB,
    )
    assert config.text_config.final_logit_softcapping == 30.0  # Gemma 2's own default: PaliGemma 2
    n_image = config.text_config.num_image_tokens
    ids = torch.randint(3, VOCAB - 1, (ROWS, SEQ))
    ids[:, :n_image] = image_token
    labels = ids.clone()
    labels[:, : n_image + 8] = -100  # the image and a prompt are not trained on
    token_type_ids = torch.zeros_like(ids)
    token_type_ids[:, n_image + 8 :] = 1
    pixels = torch.randn(ROWS, 3, 56, 56)
    return cls, config, {"input_ids": ids, "pixel_values": pixels, "token_type_ids": token_type_ids}, labels


def _step(model, inputs, labels, dtype):
    model = model.to("cuda", dtype).eval()
    inputs = {k: v.to("cuda", dtype) if v.is_floating_point() else v.to("cuda") for k, v in inputs.items()}
    out = model(**inputs, labels=labels.cuda())
    out.loss.backward()
    return out.loss.detach().float(), model.get_output_embeddings().weight.grad.float()


def _rel(a, e):
    return ((a.double() - e.double()).abs().max() / e.double().abs().max()).item()


@pytest.mark.parametrize("make", [gemma4, paligemma2], ids=["gemma4", "paligemma2"])
def test_multimodal_bf16_loss_and_head_grad_within_hf_bf16_error(make):
    torch.manual_seed(0)
    cls, config, inputs, labels = make()
    labels[0, :16] = -100
    model = cls._from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(HEAD_GAIN)
    reference = _step(copy.deepcopy(model), inputs, labels, torch.float32)
    hf = _step(copy.deepcopy(model), inputs, labels, torch.bfloat16)
    ours = _step(apply_flce(copy.deepcopy(model)), inputs, labels, torch.bfloat16)
    for name, r, h, o in zip(("loss", "head grad"), reference, hf, ours, strict=True):
        hf_error, our_error = _rel(h, r), _rel(o, r)
        assert our_error <= max(2 * hf_error, BF16_ULP), (name, our_error, hf_error)
