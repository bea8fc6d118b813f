"""flce-policy behind TRL's fused-LM-head contract, against TRL 1.16's own ``add_fused_lm_head``.

The reference is TRL's head on an identical copy of a tiny fp32 model (built from a config, no
hub): every per-token field, the loss, and every parameter's gradient of TRL's ``nll`` and
``dft`` SFT losses must agree. Then ``SFTTrainer`` end to end: a few steps with TRL's head and
with ours from the same weights log the same losses and metrics.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from test_hf_integration import assert_same_gradients, rel_err  # noqa: E402  (same TOL, 2e-5)
from trl.trainer.utils import FusedCausalLMOutput, add_fused_lm_head  # noqa: E402

from flce_policy.integrations.trl import (  # noqa: E402
    SFT_OUTPUTS,
    add_flce_lm_head,
    apply_flce_to_sft_trainer,
)
from flce_policy.kernels.ce_kernel import KERNELS_INTERPRETED  # noqa: E402
from flce_policy.kernels.driver import observe_chunks  # noqa: E402

pytestmark = pytest.mark.skipif(not KERNELS_INTERPRETED, reason="TRL's head is compared on CPU (Triton interpreter)")

VOCAB, SEQ = 96, 9
TOL = 2e-5  # fp32 vs fp32, max-norm relative
CONFIGS = {
    "llama": {},
    "gemma3_text": {"final_logit_softcapping": 5.0},
    "granite": {"logits_scaling": 2.0},
    "qwen3_moe": {
        "output_router_logits": True,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
    },  # fmt: skip
}


def tiny_model(model_type: str, seed: int = 0, **overrides):
    base = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    config = transformers.AutoConfig.for_model(model_type, **{**base, **CONFIGS[model_type], **overrides})
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).float().train()


def head_pair(model_type: str, outputs=SFT_OUTPUTS, temperature: float = 1.0, **overrides):
    """(TRL's head, ours) on two copies of the same weights."""
    ref = tiny_model(model_type, **overrides)
    ours = copy.deepcopy(ref)
    add_fused_lm_head(ref, temperature=temperature, outputs=outputs)
    add_flce_lm_head(ours, temperature=temperature, outputs=outputs)
    return ref, ours


def batch(seed: int = 0, ignored: int = 3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :ignored] = -100  # a prompt
    labels[1, -2:] = -100  # padding
    return ids, labels


def sft_loss(out, loss_type: str, num_items_in_batch=None, aux_coef: float = 0.0):
    """SFTTrainer.compute_loss's loss from a fused head's output (TRL 1.16, written out)."""
    per_token = -out.log_probs
    if loss_type == "dft":
        per_token = per_token * out.log_probs.exp().detach()
    count = out.label_mask.sum() if num_items_in_batch is None else num_items_in_batch
    loss = per_token.sum() / torch.as_tensor(count).clamp(min=1)
    return loss if out.aux_loss is None else loss + aux_coef * out.aux_loss


def assert_same_fields(got, want):
    assert type(got) is FusedCausalLMOutput
    assert torch.equal(got.label_mask, want.label_mask)
    assert got.log_probs.shape == want.log_probs.shape == got.label_mask.shape
    assert rel_err(got.log_probs, want.log_probs) < TOL
    assert (got.log_probs[~got.label_mask] == 0).all()
    assert rel_err(got.loss, want.loss) < TOL, (got.loss.item(), want.loss.item())
    for name in ("entropy", "is_top1"):
        g, w = getattr(got, name), getattr(want, name)
        if w is None:
            assert g is None, name
            continue
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert (g[~got.label_mask] == 0).all(), name
    if want.entropy is not None:
        assert rel_err(got.entropy, want.entropy) < TOL
    if want.is_top1 is not None:
        assert torch.equal(got.is_top1, want.is_top1)
    assert got.log_sum_sq_probs is None and got.mean_logits is None
    if want.aux_loss is None:
        assert got.aux_loss is None
    else:
        assert rel_err(got.aux_loss, want.aux_loss) < TOL


def with_top1_labels(model, ids, labels):
    """``labels`` with the model's own argmax at every other scored position: ``is_top1`` has hits to agree on."""
    with torch.no_grad():
        predicted = model(input_ids=ids).logits.argmax(-1)  # the forward without the fused head
    labels = labels.clone()
    hit = (labels[:, 1:] != -100) & (torch.arange(SEQ - 1) % 2 == 0)
    labels[:, 1:][hit] = predicted[:, :-1][hit]
    return labels


@pytest.mark.parametrize("loss_type", ["nll", "dft"])
@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_fields_loss_and_every_gradient_match_trl(model_type, loss_type):
    ref, ours = head_pair(model_type)
    ids, labels = batch()
    labels = with_top1_labels(ref, ids, labels)
    num_items = torch.tensor(23) if loss_type == "dft" else None  # TRL's accumulated-batch count, on one of the two
    want = ref(input_ids=ids, labels=labels, num_items_in_batch=num_items, fused_lm_head=True)
    got = ours(input_ids=ids, labels=labels, num_items_in_batch=num_items, fused_lm_head=True)
    assert_same_fields(got, want)
    assert want.is_top1.sum() >= 3 and not want.is_top1.all()  # hits and misses to agree on
    coef = getattr(ref.config, "router_aux_loss_coef", 0.0)
    sft_loss(want, loss_type, num_items, coef).backward()
    sft_loss(got, loss_type, num_items, coef).backward()
    assert_same_gradients(ours, ref)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_shift_labels_and_the_head_loss_backward(model_type):
    ref, ours = head_pair(model_type, outputs=("log_probs", "entropy"))
    ids, labels = batch(1)
    shift = torch.roll(labels, -1, dims=1)
    shift[:, -1] = -100
    shift[1, 2] = -100
    want = ref(input_ids=ids, shift_labels=shift, num_items_in_batch=30, fused_lm_head=True)
    got = ours(input_ids=ids, shift_labels=shift, num_items_in_batch=30, fused_lm_head=True)
    assert got.log_probs.shape == (2, SEQ)  # unshifted: one per position
    assert_same_fields(got, want)
    assert got.is_top1 is None  # not asked for
    want.loss.backward()
    got.loss.backward()
    assert_same_gradients(ours, ref)


def test_temperature_with_a_logit_scale_matches_trl():
    ref, ours = head_pair("granite", outputs=("log_probs",), temperature=0.7)
    ids, labels = batch(2)
    want = ref(input_ids=ids, labels=labels, fused_lm_head=True)
    got = ours(input_ids=ids, labels=labels, fused_lm_head=True)
    assert_same_fields(got, want)
    sft_loss(want, "nll").backward()
    sft_loss(got, "nll").backward()
    assert_same_gradients(ours, ref)


def test_cast_lm_head_to_fp32_on_a_bf16_model_matches_trl():
    ref = tiny_model("llama").to(torch.bfloat16)
    ours = copy.deepcopy(ref)
    add_fused_lm_head(ref, cast_lm_head_to_fp32=True, outputs=SFT_OUTPUTS)
    add_flce_lm_head(ours, cast_lm_head_to_fp32=True, outputs=SFT_OUTPUTS)
    ids, labels = batch(3)
    want = ref(input_ids=ids, labels=labels, fused_lm_head=True)
    got = ours(input_ids=ids, labels=labels, fused_lm_head=True)
    assert got.log_probs.dtype == torch.float32
    assert_same_fields(got, want)  # the head in fp32 on the same bf16 hidden states: fp32 agreement
    want.loss.backward()
    got.loss.backward()
    named = dict(ours.named_parameters())
    for name, p in ref.named_parameters():
        assert named[name].grad.dtype == torch.bfloat16
        assert rel_err(named[name].grad, p.grad) < 1e-2, name  # the bf16 backbone's backward rounds the rest


def test_peft_model_through_the_sft_helper(tmp_path):
    peft = pytest.importorskip("peft")
    base = tiny_model("llama")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    adapted = peft.get_peft_model(copy.deepcopy(base), lora)  # random adapters: one set, copied
    models = {flag: copy.deepcopy(adapted) for flag in (False, True)}
    dataset = _dataset(base)
    with pytest.raises(TypeError, match="get_base_model"):
        add_flce_lm_head(models[True])
    grads = {flag: _train(m, flag, "nll", tmp_path, dataset, steps=1)[1] for flag, m in models.items()}
    assert grads[False].numel() < sum(p.numel() for p in base.parameters())  # only the adapters train
    assert rel_err(grads[True], grads[False]) < TOL


def test_all_ignored_batch_is_a_differentiable_zero():
    ref, ours = head_pair("llama")
    ids, _ = batch()
    labels = torch.full_like(ids, -100)
    want = ref(input_ids=ids, labels=labels, fused_lm_head=True)
    got = ours(input_ids=ids, labels=labels, fused_lm_head=True)
    assert_same_fields(got, want)
    assert got.loss.item() == 0.0 and got.loss.requires_grad
    sft_loss(got, "nll").backward()  # no error, and nothing learnt
    assert all(p.grad is None or not p.grad.any() for p in ours.parameters())


def test_without_fused_lm_head_the_original_forward_runs():
    plain = tiny_model("llama")
    ref, ours = copy.deepcopy(plain), copy.deepcopy(plain)
    add_fused_lm_head(ref)
    add_flce_lm_head(ours, outputs=("log_probs",))
    ids, labels = batch()
    want = plain(input_ids=ids, labels=labels)
    got = ours(input_ids=ids, labels=labels)
    assert torch.equal(got.logits, want.logits) and torch.equal(got.loss, want.loss)
    # on top of TRL's head (as apply_flce_to_sft_trainer does): its fused_lm_head=False path
    add_flce_lm_head(ref)
    got = ref(input_ids=ids, labels=labels, num_items_in_batch=7)
    assert torch.equal(got.logits, want.logits)
    assert rel_err(got.loss, plain(input_ids=ids, labels=labels, num_items_in_batch=7).loss) < 1e-6
    # patched twice: still one level above the original, not a chain
    add_flce_lm_head(ours)
    assert torch.equal(ours(input_ids=ids).logits, plain(input_ids=ids).logits)
    assert "fused_lm_head" not in str(__import__("inspect").signature(ours.forward))  # generate() sees HF's


def test_refusals_name_the_problem():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="log_sum_sq_probs"):
        add_flce_lm_head(model, outputs=("log_probs", "log_sum_sq_probs"))
    with pytest.raises(ValueError, match="mean_logits"):
        add_flce_lm_head(model, outputs=("mean_logits",))
    with pytest.raises(ValueError, match="outputs must be"):
        add_flce_lm_head(model, outputs=("logprobs",))
    with pytest.raises(ValueError, match="temperature"):
        add_flce_lm_head(model, temperature=0.0)
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        add_flce_lm_head(tiny_model("gemma3_text"), temperature=0.7)
    with pytest.raises(ValueError, match="logit_scale"):
        add_flce_lm_head(tiny_model("llama", logit_scale=2.0))  # TRL would scale; llama's forward does not
    with pytest.raises(TypeError, match="causal LM"):
        add_flce_lm_head(torch.nn.Linear(2, 2))
    add_flce_lm_head(model, outputs=SFT_OUTPUTS)
    ids, labels = batch()
    with pytest.raises(ValueError, match="labels"):
        model(input_ids=ids, fused_lm_head=True)
    bad = labels.clone()
    bad[0, 5] = VOCAB
    with pytest.raises(ValueError, match="outside"):
        model(input_ids=ids, labels=bad, fused_lm_head=True)
    out = model(input_ids=ids, labels=labels, fused_lm_head=True)
    with pytest.raises(RuntimeError, match="entropy without a gradient"):
        (out.loss + out.entropy.sum()).backward()


def test_apply_flce_to_sft_trainer_needs_an_sft_trainer():
    with pytest.raises(TypeError, match="SFTTrainer"):
        apply_flce_to_sft_trainer(object())


# --------------------------------------------------------------------------- SFTTrainer end to end


def _tokenizer():
    from tokenizers import Tokenizer, models

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>"
    )


def _dataset(model):
    """Pre-tokenised rows the model half predicts: its greedy continuations, every third token replaced."""
    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(3, VOCAB, (8, 3), generator=g)
    with torch.no_grad():
        ids = model.generate(prompts, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    ids[:, 3::3] = torch.randint(3, VOCAB, ids[:, 3::3].shape, generator=g)
    rows = []
    for i, row in enumerate(ids.tolist()):
        row = row[: 6 + i % 4]
        prompt = 2 + i % 3  # 2-4 prompt tokens, not trained on
        rows.append({"input_ids": row, "labels": [-100] * prompt + row[prompt:]})
    return datasets.Dataset.from_list(rows)


class _GradientsBeforeStep(transformers.TrainerCallback):
    """Keeps the first optimizer step's accumulated gradients, all parameters flattened."""

    grads: torch.Tensor | None = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.grads is None:
            self.grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).clone()


def _train(model, use_flce: bool, loss_type: str, tmp_path, dataset, *, bf16: bool = False, steps: int = 3):
    """SFTTrainer's log lines (one per step) and first-step gradients, with TRL's head or ours."""
    grads = _GradientsBeforeStep()
    args = trl.SFTConfig(
        output_dir=str(tmp_path / f"{'flce' if use_flce else 'trl'}-{loss_type}-{bf16}"),
        bf16=bf16,  # SFTConfig's default is True: bf16 autocast, even on CPU
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,  # num_items_in_batch across two micro-batches
        max_steps=steps,
        # plain SGD: Adam's first steps are ~lr * sign(grad), which turns fp32 noise in near-zero gradients
        # into whole steps; with SGD the two runs' weights differ as little as their gradients do
        optim="sgd",
        learning_rate=0.5,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        data_seed=0,
        loss_type=loss_type,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = trl.SFTTrainer(
        model=model, args=args, train_dataset=dataset, processing_class=_tokenizer(), callbacks=[grads]
    )
    if use_flce:
        assert apply_flce_to_sft_trainer(trainer) is trainer
    with observe_chunks() as chunks:
        trainer.train()
    assert bool(chunks) == use_flce  # whose head ran: flce-policy's driver, or TRL's own
    return [log for log in trainer.state.log_history if "loss" in log], grads.grads


@pytest.mark.parametrize("loss_type", ["nll", "dft"])
def test_sft_trainer_logs_the_same_losses_and_metrics(loss_type, tmp_path):
    model = tiny_model("gemma3_text")
    dataset = _dataset(model)
    logs = {flag: _train(copy.deepcopy(model), flag, loss_type, tmp_path, dataset)[0] for flag in (False, True)}
    assert len(logs[True]) == len(logs[False]) == 3
    assert 0 < logs[False][0]["mean_token_accuracy"] < 1
    for got, want in zip(logs[True], logs[False], strict=True):
        for key in ("loss", "entropy", "mean_token_accuracy", "num_tokens"):
            assert math.isfinite(want[key]), key
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key


def test_sft_trainer_under_bf16_autocast_is_as_accurate_as_trls_head(tmp_path):
    """SFTConfig's default bf16=True: both heads compute in bf16; their gradients' distance to fp32 training's."""
    model = tiny_model("llama")
    dataset = _dataset(model)
    exact = _train(copy.deepcopy(model), False, "nll", tmp_path, dataset, steps=1)[1]
    trl_bf16 = _train(copy.deepcopy(model), False, "nll", tmp_path, dataset, bf16=True, steps=1)[1]
    flce_bf16 = _train(copy.deepcopy(model), True, "nll", tmp_path, dataset, bf16=True, steps=1)[1]
    trl_err, flce_err = ((g - exact).norm() / exact.norm() for g in (trl_bf16, flce_bf16))
    assert 0 < trl_err < 0.1  # bf16 did round something, and not everything
    # Ours rounds the hidden states' gradient to bf16, as F.linear's backward under autocast does (HF's own
    # lm_head); TRL's head keeps it fp32. Seen here: 0.058 vs 0.035 (llama); at the head alone 0.44% vs 0.36%.
    assert flce_err < 2 * trl_err, (flce_err, trl_err)
