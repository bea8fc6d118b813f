"""Framework integrations: one module per framework. They use the engine; the engine never imports them.

- :mod:`flce_policy.integrations.transformers` — Hugging Face causal LMs (:func:`apply_flce`).
- :mod:`flce_policy.integrations.trl` — TRL's fused-LM-head contract (``add_flce_lm_head``,
  ``apply_flce_to_sft_trainer`` for ``SFTTrainer``).
"""
