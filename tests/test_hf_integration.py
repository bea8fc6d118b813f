"""apply_flce on tiny HF causal LMs of each family, against HF's own loss path on the same weights.

The reference is the unpatched model (HF's ``ForCausalLMLoss`` on materialised logits), in fp32;
the patched copy must give the same loss and the same gradient for every parameter.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flce_policy.integrations.hf_families import FAMILIES  # noqa: E402
from flce_policy.integrations.transformers import apply_flce, causal_lm_loss, remove_flce  # noqa: E402
from flce_policy.kernels.ce_kernel import KERNELS_INTERPRETED  # noqa: E402

DEVICE = "cpu" if KERNELS_INTERPRETED else "cuda"
pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(), reason="the kernels were compiled and there is no CUDA GPU"
)

VOCAB, SEQ = 96, 9
TOL = 2e-5  # fp32 kernel vs fp32 eager, max-norm relative

#: model_type -> config overrides that exercise the family's own logit handling
FAMILY_CONFIGS = {
    "llama": {},
    "mistral": {},
    "mixtral": {"output_router_logits": True, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2": {},
    "qwen3": {},
    "qwen3_moe": {
        "output_router_logits": True,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
    },
    "gemma": {},
    "gemma2": {"final_logit_softcapping": 5.0},
    "gemma3_text": {"final_logit_softcapping": 5.0},
    "phi3": {},
    "olmo2": {},
    "cohere": {"logit_scale": 0.5},
    "cohere2": {"logit_scale": 0.5},
    "granite": {"logits_scaling": 2.0},
    # (router logits off: transformers 5.17's own granitemoe path fails with them on; mixtral and qwen3_moe cover them)
    "granitemoe": {"logits_scaling": 2.0, "num_local_experts": 4, "num_experts_per_tok": 2},
}


def tiny_config(model_type: str, **overrides):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return transformers.AutoConfig.for_model(model_type, **{**base, **FAMILY_CONFIGS.get(model_type, {}), **overrides})


def model_pair(model_type: str, seed: int = 0, **overrides):
    """(HF reference, patched copy with the same weights), both fp32 in train mode."""
    torch.manual_seed(seed)
    ref = transformers.AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides)).float().to(DEVICE)
    ref.train()
    patched = apply_flce(copy.deepcopy(ref))
    return ref, patched


def batch(seed: int = 0, rows: int = 2, ignored: int = 3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :ignored] = -100  # a prompt that is not trained on
    return ids.to(DEVICE), labels.to(DEVICE)


def rel_err(a: torch.Tensor, e: torch.Tensor) -> float:
    a, e = a.detach().double(), e.detach().double()
    return ((a - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()


def assert_same_training_step(ref, patched, **inputs):
    expected, got = ref(**inputs), patched(**inputs)
    assert got.logits is None, "the patched training forward must not return logits"
    assert rel_err(got.loss, expected.loss) < TOL, (got.loss.item(), expected.loss.item())
    expected.loss.backward()
    got.loss.backward()
    assert_same_gradients(patched, ref)
    return got


def assert_same_gradients(ours, ref):
    """Every parameter's gradient in ``ours`` equals ``ref``'s (a missing one must be absent or zero)."""
    named = dict(ours.named_parameters())
    checked = 0
    for name, p in ref.named_parameters():
        if p.grad is None:
            assert named[name].grad is None or not named[name].grad.any(), name
            continue
        assert rel_err(named[name].grad, p.grad) < TOL, f"grad of {name}"
        checked += 1
    assert checked >= 10


def test_family_table_is_what_is_tested():
    # every parametrized family is in the table; the sweep (tests/test_hf_sweep.py) matches the rest
    assert set(FAMILY_CONFIGS) <= set(FAMILIES)


@pytest.mark.parametrize("model_type", sorted(FAMILY_CONFIGS))
def test_family_matches_hf_loss_and_every_gradient(model_type):
    ref, patched = model_pair(model_type)
    ids, labels = batch()
    out = assert_same_training_step(ref, patched, input_ids=ids, labels=labels)
    assert type(out) is type(ref(input_ids=ids, labels=labels))
    if FAMILY_CONFIGS[model_type].get("output_router_logits"):
        assert out.aux_loss is not None  # HF's router loss is part of the loss checked above


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "qwen3_moe"])
def test_num_items_in_batch_and_shift_labels(model_type):
    ref, patched = model_pair(model_type)
    ids, labels = batch(1)
    num_items = torch.tensor(40, device=DEVICE)  # the whole accumulated batch's tokens, not this call's
    assert_same_training_step(ref, patched, input_ids=ids, labels=labels, num_items_in_batch=num_items)
    ref.zero_grad()
    patched.zero_grad()
    shift = torch.roll(labels, -1, dims=1)
    shift[:, -1] = -100
    shift[1, 2] = -100
    # HF computes a loss only with labels, and then takes shift_labels (context parallelism) as given
    assert_same_training_step(ref, patched, input_ids=ids, labels=labels, shift_labels=shift)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_without_labels_and_in_eval_the_logits_are_hf_own(model_type):
    ref, patched = model_pair(model_type)
    ids, labels = batch(2)
    with torch.no_grad():
        assert torch.equal(patched(input_ids=ids).logits, ref(input_ids=ids).logits)
        ref.eval()
        patched.eval()
        got, expected = patched(input_ids=ids, labels=labels), ref(input_ids=ids, labels=labels)
    assert torch.equal(got.logits, expected.logits)
    assert torch.equal(got.loss, expected.loss)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_eval_mode_with_autograd_recording_runs_the_fused_loss(model_type):
    # from_pretrained returns a model in eval(): training through it (dropout off, as RL fine-tuning
    # does) must still go through the fused loss, with HF's loss and gradients
    ref, patched = model_pair(model_type, seed=12)
    ref.eval()
    patched.eval()
    ids, labels = batch(12)
    out = assert_same_training_step(ref, patched, input_ids=ids, labels=labels)
    assert out.logits is None
    # return_dict=False: HF's tuple, its loss (router loss included) first, [B, T, 0] logits in place
    tuple_out = patched(input_ids=ids, labels=labels, return_dict=False)
    expected = ref(input_ids=ids, labels=labels, return_dict=False)
    assert rel_err(tuple_out[0], expected[0]) < TOL
    logits_at = next(i for i, x in enumerate(expected) if isinstance(x, torch.Tensor) and x.ndim == 3)
    assert len(tuple_out) == len(expected) and tuple_out[logits_at].shape == (*ids.shape, 0)


def test_frozen_model_without_grad_inputs_runs_hf_forward():
    # nothing requires grad: no backward will come, so HF's forward (with logits) runs
    ref, patched = model_pair("llama", seed=13)
    patched.requires_grad_(False)
    ids, labels = batch(13)
    got = patched(input_ids=ids, labels=labels)
    assert got.logits is not None and torch.equal(got.loss, ref(input_ids=ids, labels=labels).loss)
    # an input that requires grad (inputs_embeds) brings the fused loss back
    embeds = patched.get_input_embeddings()(ids).detach().requires_grad_(True)
    fused = patched(inputs_embeds=embeds, labels=labels)
    assert fused.logits is None
    assert rel_err(fused.loss, ref(inputs_embeds=embeds.detach(), labels=labels).loss) < TOL


def test_clear_errors_for_meta_labels_and_a_string_num_items():
    _, patched = model_pair("llama", seed=14)
    ids, labels = batch(14)
    with pytest.raises(ValueError, match=r"labels are on the meta device"):
        patched(input_ids=ids, labels=labels.to("meta"))
    hidden, weight = torch.randn(1, 4, 32, device=DEVICE), torch.randn(VOCAB, 32, device=DEVICE)
    with pytest.raises(TypeError, match=r"num_items_in_batch must be an int or a tensor.*str '5'"):
        causal_lm_loss(hidden, weight, labels[:1, :4], num_items_in_batch="5")


def test_gradient_accumulation_equals_one_batch():
    # 4 micro-batches, each divided by the whole batch's token count, give one batch's gradient
    ref, patched = model_pair("llama", seed=3)
    ids, labels = batch(4, rows=8, ignored=5)
    ref(input_ids=ids, labels=labels).loss.backward()  # HF, one batch: mean over all its tokens
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    num_items = (shifted != -100).sum()
    for i in range(4):
        rows = slice(2 * i, 2 * i + 2)
        patched(input_ids=ids[rows], labels=labels[rows], num_items_in_batch=num_items).loss.backward()
    named = dict(patched.named_parameters())
    for name, p in ref.named_parameters():
        assert rel_err(named[name].grad, p.grad) < TOL, name


def test_token_accuracy_predicted_tokens_and_entropy_on_the_output():
    ref, _ = model_pair("gemma2")
    patched = apply_flce(
        copy.deepcopy(ref), return_token_accuracy=True, return_predicted_tokens=True, return_entropy=True
    )
    ids, labels = batch(5)
    out = patched(input_ids=ids, labels=labels)
    with torch.no_grad():
        logits = ref(input_ids=ids).logits
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    valid = shifted != -100
    predicted = torch.where(valid, logits.argmax(-1), -1)
    assert torch.equal(out.predicted_tokens, predicted)
    accuracy = ((predicted == shifted) & valid).sum() / valid.sum()
    assert abs(out.token_accuracy.item() - accuracy.item()) < 1e-6
    # HF's softcapped logits: each position's entropy of its next-token distribution, 0 where not scored
    entropy = -(torch.softmax(logits.double(), -1) * torch.log_softmax(logits.double(), -1)).sum(-1)
    torch.testing.assert_close(out.entropy.double(), torch.where(valid, entropy, 0.0), rtol=0, atol=1e-5)


def test_causal_lm_loss_is_hf_for_causal_lm_loss():
    from transformers.loss.loss_utils import ForCausalLMLoss

    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(3, 7, 16, generator=g).to(DEVICE)
    weight = (torch.randn(VOCAB, 16, generator=g) / 4).to(DEVICE)
    labels = torch.randint(0, VOCAB, (3, 7), generator=g).to(DEVICE)
    labels[1, 4:] = -100
    logits = hidden @ weight.T
    for num_items in (None, torch.tensor(11, device=DEVICE), 11):
        expected = ForCausalLMLoss(logits, labels, VOCAB, num_items_in_batch=num_items)
        got = causal_lm_loss(hidden, weight, labels, num_items_in_batch=num_items)
        assert rel_err(got, expected) < TOL


def test_autocast_fp32_master_weights():
    # HF Trainer bf16=True on an fp32 model: the loss runs in bf16, gradients come back fp32
    ref, patched = model_pair("llama", seed=7)
    ids, labels = batch(7)
    expected = ref(input_ids=ids, labels=labels)  # fp32 reference
    expected.loss.backward()
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        got = patched(input_ids=ids, labels=labels)
    got.loss.backward()
    assert got.loss.dtype == torch.float32
    assert rel_err(got.loss, expected.loss) < 2e-2
    named = dict(patched.named_parameters())
    for name in dict(ref.named_parameters()):
        assert named[name].grad.dtype == torch.float32
    head = patched.lm_head.weight.grad
    assert rel_err(head, ref.lm_head.weight.grad) < 5e-2


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_bf16_softcap_is_rounded_as_hf_rounds_it(model_type):
    # HF softcaps bf16 logits op by op; apply_flce rounds the same way unless told fp32.
    torch.manual_seed(3)
    config = tiny_config(model_type, final_logit_softcapping=2.0)  # low: logits of a few units are bent
    ref = transformers.AutoModelForCausalLM.from_config(config).to(DEVICE, torch.bfloat16).train()
    with torch.no_grad():
        ref.lm_head.weight.mul_(8.0)  # tied to the embedding in both families; logits of several units
    ids, labels = batch(3)
    expected = ref(input_ids=ids, labels=labels)
    expected.loss.backward()

    def step(**options):
        patched = apply_flce(copy.deepcopy(ref), **options)
        patched.zero_grad()
        out = patched(input_ids=ids, labels=labels)
        out.loss.backward()
        return out.loss, patched.lm_head.weight.grad, patched.model.layers[-1].mlp.down_proj.weight.grad

    hf = (expected.loss, ref.lm_head.weight.grad, ref.model.layers[-1].mlp.down_proj.weight.grad)
    rounded = [rel_err(a, b) for a, b in zip(step(), hf, strict=True)]
    fp32 = [rel_err(a, b) for a, b in zip(step(softcap_rounding="fp32"), hf, strict=True)]
    assert rounded[0] < 1e-5, (rounded, fp32)  # loss: HF's own numbers
    assert max(rounded[1:]) < 2e-2, (rounded, fp32)  # gradients: a bf16 last-bit flip here and there
    assert fp32[0] > 10 * max(rounded[0], 1e-7) and min(fp32[1:]) > max(rounded[1:]), (rounded, fp32)


def test_generic_family_and_clear_refusals():
    # An unlisted model_type with HF's standard forward shape goes through the generic path.
    ref, patched = model_pair("llama", seed=8)
    ids, labels = batch(8)
    patched.config.model_type = "my_llama_variant"
    apply_flce(patched)
    assert_same_training_step(ref, patched, input_ids=ids, labels=labels)

    patched.config.logit_scale = 0.3  # an unknown family that scales its logits: refused, not guessed
    with pytest.raises(ValueError, match=r"does not know how model_type='my_llama_variant' applies logit_scale"):
        apply_flce(patched)
    with pytest.raises(TypeError, match=r"needs a transformers \*ForCausalLM"):
        apply_flce(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"takes no 'reduction'"):
        apply_flce(ref, reduction="sum")
    with pytest.raises(ValueError, match=r"label_smoothing"):
        apply_flce(ref, label_smoothing=2.0)


@pytest.mark.parametrize("adapter", ["lora_on_head", "modules_to_save"])
def test_an_adapter_on_the_head_is_refused_not_left_out(adapter):
    """PEFT's LoRA on lm_head, or a modules_to_save copy of it, changes what the head computes: the fused
    loss, which reads the head's base weight, would leave the adapter out. The model's own loss differs from
    one computed without the adapter, so a silent run would be a wrong loss: it is refused by name."""
    peft = pytest.importorskip("peft")
    model, _ = model_pair("llama", seed=9)
    if adapter == "lora_on_head":
        lora = peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    else:
        lora = peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"], init_lora_weights=False)
    adapted = peft.get_peft_model(model, lora)
    if adapter == "modules_to_save":
        with torch.no_grad():
            adapted.get_base_model().lm_head.modules_to_save["default"].weight.mul_(1.5)
    ids, labels = batch(8)
    with_adapter = adapted(input_ids=ids, labels=labels).loss
    with adapted.disable_adapter():
        without_adapter = adapted(input_ids=ids, labels=labels).loss
    assert abs(with_adapter.item() - without_adapter.item()) > 1e-3  # the adapter on the head matters
    with pytest.raises(TypeError, match=r"lm_head is wrapped by an adapter"):
        apply_flce(adapted)


class _GainLlama(transformers.LlamaForCausalLM):
    """A family the table does not know, multiplying its logits by a config value no list names."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        hidden = self.model(input_ids=input_ids).last_hidden_state
        logits = self.lm_head(hidden) * self.config.my_logit_gain
        loss = None if labels is None else self.loss_function(logits, labels, self.vocab_size, **kwargs)
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


def test_forward_guard_reads_the_model_own_source():
    # any self.… value the forward reads between lm_head and its loss must be neutral or applied
    config = tiny_config("llama")
    config.my_logit_gain = 3.0
    torch.manual_seed(15)
    model = _GainLlama(config).to(DEVICE)
    with pytest.raises(ValueError, match=r"between lm_head and its loss with config.my_logit_gain=3.0"):
        apply_flce(model)
    model.config.my_logit_gain = 1.0  # neutral: the fused loss is HF's
    ref = copy.deepcopy(model)
    patched = apply_flce(model)
    ids, labels = batch(15)
    assert_same_training_step(ref, patched, input_ids=ids, labels=labels)
    # a loss other than ForCausalLMLoss is refused
    other = copy.deepcopy(ref)
    other.loss_type = "ForMaskedLM"
    with pytest.raises(ValueError, match=r"loss_function is 'ForMaskedLMLoss'.*not HF's ForCausalLMLoss"):
        apply_flce(other)


def test_remove_flce_restores_hf_forward():
    ref, patched = model_pair("llama", seed=9)
    ids, labels = batch(9)
    remove_flce(patched)
    out = patched(input_ids=ids, labels=labels)
    assert out.logits is not None
    assert torch.equal(out.loss, ref(input_ids=ids, labels=labels).loss)


def test_hf_trainer_passes_num_items_in_batch():
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    _, patched = model_pair("llama", seed=10)
    seen = []
    original = patched.forward

    @functools.wraps(original)  # the Trainer reads the forward's signature
    def spy(*args, **kwargs):
        seen.append(kwargs.get("num_items_in_batch"))
        return original(*args, **kwargs)

    patched.forward = spy
    ids, labels = batch(10, rows=4)
    rows = [{"input_ids": i, "labels": lab} for i, lab in zip(ids.cpu(), labels.cpu(), strict=True)]
    args = TrainingArguments(
        output_dir="/tmp/flce-trainer-test",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=1,
        report_to=[],
        use_cpu=DEVICE == "cpu",
        save_strategy="no",
        logging_steps=1,
    )
    Trainer(model=patched, args=args, train_dataset=rows).train()
    assert seen and all(n is not None for n in seen)


def test_compiled_training_step_has_no_graph_break_and_equals_hf():
    # torch.compile(fullgraph=True) of a patched model's step: one graph (fullgraph raises at any graph
    # break, naming it: one trace, not a second one by torch._dynamo.explain), HF's loss and gradients
    ref, patched = model_pair("gemma2", seed=11)
    ids, labels = batch(11)

    def loss_of(input_ids, labels):
        return patched(input_ids=input_ids, labels=labels).loss

    got = torch.compile(loss_of, fullgraph=True, backend="aot_eager")(ids, labels)
    expected = ref(input_ids=ids, labels=labels).loss
    assert rel_err(got, expected) < TOL
    got.backward()
    expected.backward()
    named = dict(patched.named_parameters())
    for name, p in ref.named_parameters():
        assert rel_err(named[name].grad, p.grad) < TOL, name
