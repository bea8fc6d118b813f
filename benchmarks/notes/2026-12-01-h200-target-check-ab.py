"""Scratch: A/B of the target check placement, eager, one run, interleaved rounds."""
import statistics
import time

import torch

import flce_policy.loss as L
import flce_policy.targets as T
from flce_policy import fused_linear_cross_entropy

a = torch.randn(8192, 8192, device="cuda")
b = torch.ones((), device="cuda", dtype=torch.bool)
torch.cuda.synchronize()
for _ in range(3):
    c = a @ a
    t = time.perf_counter()
    f = b.to("cpu", non_blocking=True)
    dt = time.perf_counter() - t
    print(f"to(cpu, non_blocking) with a matmul queued: {dt * 1e3:.3f} ms host, pinned={f.is_pinned()}")
    torch.cuda.synchronize()
del a, c

new_start = T.start_target_check


def immediate(target, vocab, ignore_index):
    # the check as it was before: torch ops and a host read at the start of the call
    bad = ((target < 0) | (target >= vocab)) & (target != ignore_index)
    if bool(bad.any()):
        raise ValueError("bad target")
    return target, None


def nothing(target, vocab, ignore_index):
    return target, None


def f(x, w, y):
    return fused_linear_cross_entropy(x, w, y)


for shape in ((4096, 1024, 32768), (8192, 4096, 128256)):
    BT, H, V = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(BT, H, device="cuda", generator=g) / 8).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(V, H, device="cuda", generator=g) / 64).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, V, (BT,), device="cuda", generator=g)
    variants = {"deferred": new_start, "immediate": immediate, "none": nothing}
    res = {k: [] for k in variants}
    host = {k: [] for k in variants}
    n = 30 if BT == 4096 else 8
    for _ in range(9):
        for name, fn in variants.items():
            L.start_target_check = fn
            for _ in range(2):
                f(x, w, y).backward()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(n):
                f(x, w, y).backward()
                x.grad = None
                w.grad = None
            torch.cuda.synchronize()
            res[name].append((time.perf_counter() - t) / n * 1e3)
            torch.cuda.synchronize()
            t = time.perf_counter()
            f(x, w, y).backward()
            host[name].append((time.perf_counter() - t) * 1e3)
            torch.cuda.synchronize()
    for name in variants:
        print(f"{shape} {name:10s} pipelined median {statistics.median(res[name]):.3f} min {min(res[name]):.3f} ms "
              f"(rounds {', '.join(f'{r:.3f}' for r in res[name])}); host per step {statistics.median(host[name]):.3f}")
    L.start_target_check = new_start
