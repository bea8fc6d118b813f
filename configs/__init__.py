"""Packaged per-GPU default policies (YAML), read through importlib.resources. No code: imports nothing."""
