"""Triton kernels and the chunk driver that runs a validated Geometry."""
