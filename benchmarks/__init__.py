"""Benchmark suite: fwd+bwd time and peak memory of FLCE methods against the three-GEMM floor."""
