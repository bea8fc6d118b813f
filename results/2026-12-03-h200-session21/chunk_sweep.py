# ruff: noqa
"""Session 21 (issue 25): the ws form at 8192 rows against one chunk at the six small heads, 16384 tokens, for the
H200 rule's ws_inner (8192 rows, or a 5 GiB slab budget: one chunk at five of the six). Interleaved, busy start,
9 repeats, beside the floor and the installed default. Run: PYTHONPATH=/tmp/site python3 this.py
"""

from flce_policy.benchmarks.methods import FLOOR, default_methods, fixed_chunk_methods
from flce_policy.benchmarks.suite import run_suite

methods = [m for m in default_methods() if m.name in (FLOOR, "ours_default_bf16")]
methods += fixed_chunk_methods((8192,), "bf16", "scaled_exp_ws")
shapes = [
    (16384, 896, 151936),
    (16384, 1024, 131072),
    (16384, 1152, 262144),
    (16384, 2048, 128256),
    (16384, 2048, 151936),
    (16384, 3072, 128256),
]
for r in run_suite(shapes, methods, repeats=9, busy_start=True, interleave=True):
    print(
        f"{'x'.join(map(str, r.shape)):>20} {r.method:36s} {r.chunk_size or '-':>6} "
        f"{r.median_ms or 0:8.2f} ms x{r.x_floor or 0:.3f} {(r.peak_bytes or 0) / 2**30:.2f} GiB {r.status}",
        flush=True,
    )
