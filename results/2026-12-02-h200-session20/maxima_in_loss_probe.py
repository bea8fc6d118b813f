# ruff: noqa
"""Session 20 probe (issue 26): the row maxima's cost inside the loss call, where overhead_probe_bf16max.log still
shows the Gluon GEMM 0.26-0.36 ms slower per filtered call (maxima_probe.log, the GEMM alone: 0.07 ms per chunk).

Per shape, default policy, random logits: per-kernel GPU time (profiler, 5 calls each behind a sleep) of
  dense          no filter
  dense+maxima   no filter, the GEMM told to write the maxima anyway (driver's flag_maxima forced True)
  filtered       2**-14 rescue 16
  filt-maxima    2**-14 rescue 16 with the maxima not written (flags from stale values: timing only)
Run: PYTHONPATH=/tmp/site python3 this.py
"""

import collections
import torch
from flce_policy.benchmarks.methods import make_inputs, ours, _leaf_step
from flce_policy.benchmarks.measure import warm_up
from flce_policy.engine.policy import FLCEPolicy
from flce_policy.kernels import driver

policy = FLCEPolicy.default()
original = driver.scaled_exp_logits
forced = {"value": None}


def patched(*args, **kwargs):
    if forced["value"] is not None:
        kwargs["flag_maxima"] = forced["value"]
    return original(*args, **kwargs)


driver.scaled_exp_logits = patched
filtered = {"grad_weight_filter": 2.0**-14, "grad_weight_filter_rescue": 16}
variants = {
    "dense": ({}, None),
    "dense+maxima": ({}, True),
    "filtered": (filtered, None),
    "filt-maxima": (filtered, False),
}
for shape in ((16384, 1024, 131072), (16384, 896, 151936)):
    inputs = make_inputs(*shape, logit_std=4.0)
    per = {}
    for rnd in range(2):
        for k, (options, force) in variants.items():
            forced["value"] = force
            step = _leaf_step(inputs, ours(lambda i: policy, **options)(inputs))
            warm_up(step, 2)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    torch.cuda._sleep(20_000_000)
                    step()
                torch.cuda.synchronize()
            sums = collections.Counter()
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA and "spin" not in e.name:
                    sums["gemm" if "row_scaled_exp" in e.name else "other"] += e.device_time / 5 / 1000
            per[f"{k} r{rnd}"] = sums
    forced["value"] = None
    print(f"== {shape}", flush=True)
    for k, v in per.items():
        print(f"  {k:18s} gemm {v['gemm']:.3f} ms, the rest {v['other']:.3f} ms", flush=True)
