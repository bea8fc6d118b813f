# ruff: noqa
"""Session 20 (issue 25): a second chunk sweep of the ws form at the three smallest heads, for the next session's
choice of 1152x262144's chunk (session 19's call2_chunk_sweep.log: 4096 rows 1.050x / 1.066x, 8192 rows 1.035x).
Interleaved, busy start, 9 repeats; the default (4096 rows at V 262144, 8192 at the others), the ws form at 4096
and 8192 rows and at one chunk, beside the floor.
Run: PYTHONPATH=/tmp/site python3 this.py
"""

from flce_policy.benchmarks.methods import FLOOR, default_methods, fixed_chunk_methods
from flce_policy.benchmarks.suite import run_suite

methods = [m for m in default_methods() if m.name in (FLOOR, "ours_default_bf16")]
methods += fixed_chunk_methods((4096, 8192), "bf16", "scaled_exp_ws")
for r in run_suite(
    [(16384, 1152, 262144), (16384, 1024, 131072), (16384, 896, 151936)],
    methods,
    repeats=9,
    busy_start=True,
    interleave=True,
):
    print(
        f"{'x'.join(map(str, r.shape)):>20} {r.method:36s} {r.chunk_size or '-':>6} "
        f"{r.median_ms or 0:8.2f} ms x{r.x_floor or 0:.3f} {(r.peak_bytes or 0) / 2**30:.2f} GiB {r.status}",
        flush=True,
    )
