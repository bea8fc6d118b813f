"""Benchmark suite: fwd+bwd time and peak memory of FLCE methods against the three-GEMM floor.

Measuring methods, and the training-stack benchmarks run on a GPU. May import anything in flce_policy
but the CLI (``flce-policy bench`` and ``tune`` call in here); the library never imports it. Its runs'
results live outside the package, in the repository's ``results/``.
"""
