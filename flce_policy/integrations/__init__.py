"""Framework integrations: one module per framework. They use the loss; nothing in flce_policy imports them.

May import: the front door (:mod:`flce_policy.loss`), :mod:`flce_policy.call` (its options) and
:mod:`flce_policy.distributed` (sharded heads).

- :mod:`flce_policy.integrations.transformers` — Hugging Face causal LMs (:func:`apply_flce`).
- :mod:`flce_policy.integrations.trl` — TRL's fused-LM-head contract (``add_flce_lm_head``,
  ``apply_flce_to_sft_trainer`` for ``SFTTrainer``).
"""
