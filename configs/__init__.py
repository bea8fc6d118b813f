"""Packaged per-GPU default policies (YAML), read through importlib.resources. No code of its own."""

if __name__ == "configs":  # imported from the repository root: yield to an installed `configs` (docs/layout.md)
    from flce_policy.top_level_names import hand_over

    hand_over(__name__, __path__[0])
