"""Every causal-LM and image-text-to-text model type of the installed transformers, tiny, through ``apply_flce``.

Each type is built from its own config class with the sizes shrunk (hidden 64, 2 layers, vocab 512,
fp32; state-space and linear-attention mixers of a few heads, state 16), its logit transforms
switched on with values that change the loss and its router losses on where the config has them, and
its head scaled up so that the logits are a few units wide (a softcap of 2 then bends them). A twin
with the same weights runs HF's own loss. Outcomes:

- ``matched``: in ``eval()`` mode with autograd recording, the loss (``return_dict`` True and
  False) within 1e-4 of HF's and the head and input-embedding gradients within 1e-3 (max-norm
  relative); without labels under ``no_grad``, HF's own logits;
- ``refused``: ``apply_flce`` (or the first step) raised flce-policy's ValueError/RuntimeError
  naming what the model does;
- ``skipped``: the tiny config could not be built, or HF's own forward or loss failed on it
  (text only, no images): the reason is listed;
- ``FAILED``: anything else (a different loss, or a crash from inside the library).

``python tests/hf_sweep.py`` prints the markdown table of docs/integrations.md (the matched types listed, the
others grouped by reason);
``python tests/hf_sweep.py --write docs/integrations.md`` writes it there.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import sys
import time
import warnings
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")  # as tests/conftest.py, when run as a script

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import CONFIG_MAPPING  # noqa: E402
from transformers.models.auto.modeling_auto import (  # noqa: E402
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)

from flce_policy.integrations.transformers import apply_flce  # noqa: E402

VOCAB, ROWS, SEQ = 512, 2, 4
LOSS_TOL, GRAD_TOL = 1e-4, 1e-3
HEAD_GAIN = 10.0  # head weight x10: logits of a few units, so that each transform moves the loss

#: config key -> tiny value (set where the config class has the key with an int value)
SIZES = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "n_embed", "dim", "embed_dim", "d_embed"), 64),
    **dict.fromkeys(("model_dim", "word_embed_proj_dim", "out_hidden_size", "text_hidden_size"), 64),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "d_ff", "ffn_hidden_size"), 128),
    **dict.fromkeys(("decoder_ffn_dim", "encoder_ffn_dim"), 128),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size"), 32),
    **dict.fromkeys(("shared_intermediate_size", "moe_shared_expert_intermediate_size"), 32),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers"), 2),
    **dict.fromkeys(("encoder_layers", "num_decoder_layers"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads"), 4),
    **dict.fromkeys(("decoder_attention_heads", "encoder_attention_heads"), 4),
    "num_key_value_heads": 2,
    "head_dim": 16,
    "kv_channels": 16,
    "rotary_dim": 8,
    "vocab_size": VOCAB,
    "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 16,
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "image_size": 28,
    "patch_size": 14,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    # state-space and linear-attention mixers: their defaults (128 heads of state 256, scanned in chunks of
    # 256 that a 4-token sequence is padded to) made a Mamba hybrid's step take a minute on the CPU
    **dict.fromkeys(("mamba_n_heads", "mamba_num_heads"), 8),
    **dict.fromkeys(("mamba_d_head", "mamba_head_dim"), 16),  # 8 heads x 16 = 2 x hidden 64 (expand 2)
    "mamba_d_ssm": 128,
    **dict.fromkeys(("mamba_d_state", "ssm_state_size"), 16),
    **dict.fromkeys(("mamba_chunk_size", "chunk_size"), SEQ),
    **dict.fromkeys(("linear_num_heads", "linear_num_key_heads"), 2),
    "linear_num_value_heads": 4,
    **dict.fromkeys(("linear_head_dim", "linear_key_head_dim", "linear_value_head_dim"), 16),
    # tables and towers the text path builds but barely uses (millions of parameters each, to initialise)
    "encoder_hash_byte_group_vocab": VOCAB,
    "hidden_size_global": 64,
    **dict.fromkeys(("projection_dim", "image_token_embed_dim"), 64),
    "num_embeddings": 64,
    "expert_ffn_hidden_size": 32,
}
#: multi-head latent attention's dims, consistent with each other
MLA = {"qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "kv_lora_rank": 16, "q_lora_rank": 32}
#: logit-transform attribute -> a value that changes the loss (flce_policy's TRANSFORM_ATTRIBUTES and more)
TRANSFORMS = {
    **dict.fromkeys(("final_logit_softcapping", "logit_softcapping", "logits_soft_cap", "output_logit_soft_cap"), 2.0),
    **dict.fromkeys(("logit_scale", "output_multiplier", "lm_head_multiplier"), 2.5),
    "logits_scaling": 0.4,
    "unpadded_vocab_size": VOCAB - 12,
}
ROUTER = {"output_router_logits": True, "router_aux_loss_coef": 0.1, "aux_loss_coef": 0.1}
#: extra builds of a type with another text model: name -> (model type, {sub-config: its model type})
VARIANTS = {"paligemma+gemma2": ("paligemma", {"text_config": "gemma2"})}


@dataclasses.dataclass
class Outcome:
    model_type: str
    status: str  # matched, refused, skipped, FAILED
    detail: str = ""
    seconds: float = 0.0


def model_types() -> list[str]:
    names = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    return sorted(names) + sorted(VARIANTS)


def _tiny_kwargs(
    config_class: type, sub_types: dict[str, str] | None = None, per_layer: bool = False
) -> dict[str, Any]:
    """Tiny sizes for ``config_class``'s keys; ``per_layer``: also cut its per-layer lists to 2 layers
    (their last two entries) and share no KV layers (the retry for configs that check those)."""
    default = config_class()
    values = default.to_dict()
    kwargs: dict[str, Any] = {k: v for k, v in SIZES.items() if type(values.get(k)) is int}
    layers = values.get("num_hidden_layers")
    if per_layer and isinstance(layers, int):
        kwargs.update({k: v[-2:] for k, v in values.items() if isinstance(v, list) and len(v) == layers})
        if values.get("num_kv_shared_layers"):
            kwargs["num_kv_shared_layers"] = 0
    if "head_dim" in values:  # None in some configs whose attention needs it set
        kwargs["head_dim"] = SIZES["head_dim"]
    if "qk_rope_head_dim" in values:
        kwargs.update({k: v for k, v in MLA.items() if values.get(k) is not None})
        kwargs["head_dim"] = MLA["qk_rope_head_dim"]
    rope = values.get("rope_parameters")
    if isinstance(rope, dict) and "mrope_section" in rope:
        kwargs["rope_parameters"] = {**rope, "mrope_section": [2, 3, 3]}  # 2 * 8 = head_dim 16
    for key in (*TRANSFORMS, *ROUTER):
        if key in values and not isinstance(values[key], dict):
            kwargs[key] = {**TRANSFORMS, **ROUTER}[key]
    for name in getattr(default, "sub_configs", None) or {}:
        sub = getattr(default, name, None)
        sub_type = (sub_types or {}).get(name)
        if sub_type is not None:
            kwargs[name] = {"model_type": sub_type, **_tiny_kwargs(CONFIG_MAPPING[sub_type])}
        elif sub is not None and hasattr(sub, "to_dict"):
            kwargs[name] = _tiny_kwargs(type(sub))
    return kwargs


def build(model_type: str) -> torch.nn.Module:
    """The tiny fp32 model of ``model_type`` (or of a VARIANTS entry), head scaled by HEAD_GAIN, in eval()."""
    try:
        return _build(model_type, per_layer=False)
    except Exception:  # noqa: BLE001 - once more with its per-layer lists cut to the 2 layers
        return _build(model_type, per_layer=True)


def _build(model_type: str, per_layer: bool) -> torch.nn.Module:
    base_type, sub_types = VARIANTS.get(model_type, (model_type, None))
    config_class = CONFIG_MAPPING[base_type]
    config = config_class(**_tiny_kwargs(config_class, sub_types, per_layer))
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(base_type) or MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[base_type]
    torch.manual_seed(0)
    model = getattr(transformers, name)._from_config(config, dtype=torch.float32)
    head = model.get_output_embeddings()
    if head is not None and isinstance(getattr(head, "weight", None), torch.Tensor):
        with torch.no_grad():
            head.weight.mul_(HEAD_GAIN)
    return model.eval()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB - 12, (ROWS, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :2] = -100
    return ids, labels


def _rel(a: torch.Tensor | None, e: torch.Tensor | None) -> float:
    if a is None or e is None:
        return 0.0 if a is None and e is None else float("inf")
    a, e = a.detach().double(), e.detach().double()
    return ((a - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()


def _grads(model: torch.nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    return head.weight.grad, getattr(getattr(embed, "weight", None), "grad", None)


def _first_line(error: BaseException) -> str:
    """The error's type and message on one line (a validator's reason included), cut at 200 characters."""
    text = " ".join(line.strip() for line in str(error).strip().split("\n") if line.strip()) or "(no message)"
    return f"{type(error).__name__}: {text[:200]}"


def _is_ours(error: BaseException) -> bool:
    """flce-policy's own clear error (raised from its integration code), not a crash inside a library."""
    tb = error.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return isinstance(error, (ValueError, RuntimeError, TypeError)) and "flce_policy" in tb.tb_frame.f_code.co_filename


def run(model_type: str) -> Outcome:
    start = time.perf_counter()
    outcome = _run(model_type)
    outcome.seconds = time.perf_counter() - start
    return outcome


def _run(model_type: str) -> Outcome:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            ref = build(model_type)
        except Exception as error:  # noqa: BLE001 - a type that cannot be built tiny is listed, with why
            return Outcome(model_type, "skipped", f"not built tiny: {_first_line(error)}")
        ids, labels = _inputs()
        try:
            twin = copy.deepcopy(ref)
        except Exception:  # noqa: BLE001 - some modules keep non-leaf tensors: build the twin again
            twin = build(model_type)
        try:  # HF's own numbers first: a type whose own text-only path fails is skipped
            expected = ref(input_ids=ids, labels=labels, use_cache=False)
            expected.loss.backward()
            with torch.no_grad():  # the tuple output's loss and the logits: values only (the step above has the grads)
                expected_tuple = ref(input_ids=ids, labels=labels, use_cache=False, return_dict=False)[0]
                expected_logits = ref(input_ids=ids, use_cache=False).logits
        except Exception as error:  # noqa: BLE001
            return Outcome(model_type, "skipped", f"HF's own text-only loss fails: {_first_line(error)}")
        try:
            apply_flce(twin)
            got = twin(input_ids=ids, labels=labels, use_cache=False)
            got.loss.backward()
            with torch.no_grad():
                got_tuple = twin(input_ids=ids, labels=labels, use_cache=False, return_dict=False)[0]
                same_logits = torch.equal(twin(input_ids=ids, use_cache=False).logits, expected_logits)
        except Exception as error:  # noqa: BLE001
            if _is_ours(error):
                return Outcome(model_type, "refused", _first_line(error))
            return Outcome(model_type, "FAILED", f"crash: {_first_line(error)}")
        errors = {
            "loss": _rel(got.loss, expected.loss),
            "tuple loss": _rel(got_tuple, expected_tuple),
            "head grad": _rel(_grads(twin)[0], _grads(ref)[0]),
            "embedding grad": _rel(_grads(twin)[1], _grads(ref)[1]),
        }
        limits = {"loss": LOSS_TOL, "tuple loss": LOSS_TOL, "head grad": GRAD_TOL, "embedding grad": GRAD_TOL}
        bad = [f"{k} {v:.1e}" for k, v in errors.items() if not v <= limits[k]]
        if got.logits is not None or not same_logits:
            bad.append("logits" if not same_logits else "training logits returned")
        if bad:
            return Outcome(model_type, "FAILED", "off from HF: " + ", ".join(bad))
        return Outcome(model_type, "matched", f"loss {expected.loss.item():.4f}")


#: a reason longer than this is cut (with an ellipsis): the table names the error, the sweep prints it whole
REASON_CHARS = 40


def reason(detail: str) -> str:
    """A non-matched outcome's detail as the table shows it: one line; of an error wrapping others (a config
    validator's) the innermost, which names the cause; the model's class name before ``.forward`` said
    generically (so one refusal reads the same for every type it hits); cut to :data:`REASON_CHARS`."""
    text = " ".join(detail.split())
    errors = list(re.finditer(r"\b\w+(?:Error|Exception): ", text))
    if len(errors) > 1:
        text = text[: errors[0].start()] + text[errors[-1].start() :]
    text = re.sub(r"^(\w+: )\w+\.forward\b", r"\1its forward", text)
    if len(text) > REASON_CHARS:
        text = text[: REASON_CHARS - 1].rstrip() + "…"
    return text.replace("|", "\\|")


def markdown(outcomes: list[Outcome]) -> str:
    """The matched types in one list, then one table row per outcome and reason with every type it applies to."""
    counts = {s: sum(o.status == s for o in outcomes) for s in ("matched", "refused", "skipped", "FAILED")}
    matched = [f"`{o.model_type}`" for o in outcomes if o.status == "matched"]
    groups: dict[tuple[str, str], list[str]] = {}
    for o in outcomes:
        if o.status != "matched":
            groups.setdefault((o.status, reason(o.detail)), []).append(f"`{o.model_type}`")
    order = {"FAILED": 0, "refused": 1, "skipped": 2}
    lines = [
        f"Swept with transformers {transformers.__version__}, torch {torch.__version__} ("
        + ", ".join(f"{n} {s}" for s, n in counts.items())
        + f" of {len(outcomes)}).",
        "",
        f"**matched** ({len(matched)}): " + ", ".join(matched) + ".",
        "",
        "| outcome | model types | reason |",
        "| --- | --- | --- |",
    ]
    for (status, why), types in sorted(groups.items(), key=lambda item: (order[item[0][0]], item[1][0])):
        lines.append(f"| {status} | {', '.join(types)} | {why} |")
    return "\n".join(lines)


#: docs/integrations.md's generated region lies between these lines
DOC_MARKERS = (
    "<!-- hf-sweep table: generated by `python tests/hf_sweep.py --write docs/integrations.md` -->",
    "<!-- end of hf-sweep table -->",
)


def write_into(path: str, table: str) -> None:
    """Replace the generated region of ``path`` (between :data:`DOC_MARKERS`) by ``table``."""
    with open(path) as f:
        text = f.read()
    start, end = text.index(DOC_MARKERS[0]), text.index(DOC_MARKERS[1])
    with open(path, "w") as f:
        f.write(text[: start + len(DOC_MARKERS[0])] + "\n\n" + table + "\n\n" + text[end:])


def main(argv: list[str]) -> None:
    """``[--write DOC] [model_type ...]``: sweep (all types by default), print the table or write it into DOC."""
    transformers.logging.set_verbosity_error()
    doc = None
    if argv[:1] == ["--write"]:
        doc, argv = argv[1], argv[2:]
    outcomes = []
    for model_type in argv or model_types():
        outcomes.append(run(model_type))
        o = outcomes[-1]
        print(f"{o.status:8s} {o.model_type:28s} {o.seconds:5.2f}s {o.detail}", file=sys.stderr, flush=True)
    if doc is None:
        print(markdown(outcomes))
    else:
        write_into(doc, markdown(outcomes))


if __name__ == "__main__":
    main(sys.argv[1:])
