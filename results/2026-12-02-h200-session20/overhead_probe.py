# ruff: noqa
"""Session 20 probe (issue 26): the grad_weight filter's overhead on random logits (std 4, nothing skippable).

The gap probe (call 1) found the GPU idle < 0.1 ms in a dense, a filtered and a filtered-without-the-read call
behind a sleep kernel, so the bench's +3-5% is in the kernels. Here, per shape under the default policy:
15 interleaved rounds of the bench's timing (busy start) of dense / 2**-14 rescue 16 / the same with the
dense-or-filtered choice fixed to dense without its read ("no_read"), medians; then 5 profiled calls of each and
the per-kernel-name GPU time (the sleep kernel left out), side by side.
Run: PYTHONPATH=/tmp/site python3 this.py
"""

import statistics, collections
import torch
from flce_policy.benchmarks.methods import make_inputs, ours, _leaf_step
from flce_policy.benchmarks.measure import time_call, warm_up
from flce_policy.engine.policy import FLCEPolicy
from flce_policy.kernels import weight_grad_filter as wgf

policy = FLCEPolicy.default()
reading = wgf.FlaggedTiles.dense_is_faster
filtered = {"grad_weight_filter": 2.0**-14, "grad_weight_filter_rescue": 16}
variants = {"dense": {}, "f14r16": filtered, "no_read": filtered}


def patched(label):
    wgf.FlaggedTiles.dense_is_faster = (lambda self, cost: True) if label == "no_read" else reading


for shape in ((16384, 1024, 131072), (16384, 896, 151936), (16384, 2048, 128256)):
    inputs = make_inputs(*shape, logit_std=4.0)
    steps = {k: _leaf_step(inputs, ours(lambda i: policy, **o)(inputs)) for k, o in variants.items()}
    for k, s in steps.items():
        patched(k)
        warm_up(s, 3)
    times = collections.defaultdict(list)
    for _ in range(15):
        for k, s in steps.items():
            patched(k)
            times[k].append(time_call(s, busy_start=True))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"===== {shape}: " + ", ".join(f"{k} {m:.3f} ms ({m / med['dense']:.4f})" for k, m in med.items()), flush=True
    )
    per = {}
    for k, s in steps.items():
        patched(k)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                torch.cuda._sleep(20_000_000)
                s()
            torch.cuda.synchronize()
        sums = collections.Counter()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA and "spin" not in e.name:
                sums[e.name[:60]] += e.device_time / 5 / 1000
        per[k] = sums
    names = sorted(set().union(*per.values()), key=lambda n: -per["dense"].get(n, 0) - per["f14r16"].get(n, 0))
    print("  ms/call  " + "  ".join(f"{k:>8}" for k in per), flush=True)
    print("  total    " + "  ".join(f"{sum(v.values()):8.3f}" for v in per.values()), flush=True)
    for n in names:
        print("  " + "  ".join(f"{per[k].get(n, 0):8.3f}" for k in per) + f"  {n}", flush=True)
    del steps, inputs
    torch.cuda.empty_cache()
