"""Benchmark suite: fwd+bwd time and peak memory of FLCE methods against the three-GEMM floor.

Measuring methods, and the training-stack benchmarks run on a GPU. May import anything in flce_policy
but the CLI (``flce-policy bench`` and ``tune`` call in here); the library never imports it. Its runs'
results live outside the package, in the repository's ``results/``.
"""

if __name__ == "benchmarks":  # imported from the repository root: yield to an installed `benchmarks` (docs/layout.md)
    from flce_policy.top_level_names import hand_over

    hand_over(__name__, __path__[0])
