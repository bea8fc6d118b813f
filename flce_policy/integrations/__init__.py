"""Framework integrations: one module per framework. They use the engine; the engine never imports them.

- :mod:`flce_policy.integrations.transformers` — Hugging Face causal LMs (:func:`apply_flce`).
"""
