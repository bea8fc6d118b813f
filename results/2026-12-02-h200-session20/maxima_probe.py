# ruff: noqa
"""Session 20 probe (issue 26): what the Gluon GEMM's row maxima (HAS_MAXIMA, a grad_weight filter's input) cost.

overhead_probe.log: with the filter on random logits the Gluon row-scaled GEMM took 0.30-0.49 ms more per call
(6-7% of it at H 896-1024). Variants of kernels/gluon_exp_gemm.py's epilogue, each a patched copy of the file
imported from /tmp, timed alone on one 8192-row chunk (20 launches, median, interleaved 5 rounds):
  none     HAS_MAXIMA False (the dense call's GEMM)
  e_max    the current maxima: max over the fp32 exponentials
  bf16_max max over the bf16-rounded exponentials (the slab's values), packed bf16 compares
  z_max    max over the fp32 products before the exp, exponentiated once per row (the same value: exp2 of an fma
           is monotone in z)
  store    the tile sum stored as the "maxima" (no reduction: the store's cost alone)
"""

import importlib.util, statistics, sys
import torch

src_path = sys.argv[1]
src = open(src_path).read()
cur = "                gl.store(maxima_ptr + slot, gl.max(e, axis=1), mask=row_ok)\n"
assert cur in src
store_old = "            c_smem.store(e.to(out_desc.dtype))\n"
assert store_old in src
exp_line = "            e = gl.exp2(gl.fma(acc, log2e, neg))\n"
assert exp_line in src
variants = {
    "e_max": src,
    "bf16_max": src.replace(cur, "                pass\n").replace(
        store_old,
        "            e16 = e.to(out_desc.dtype)\n"
        "            if HAS_MAXIMA:\n"
        "                gl.store(maxima_ptr + slot, gl.max(e16, axis=1).to(gl.float32), mask=row_ok)\n"
        "            c_smem.store(e16)\n",
    ),
    "z_max": src.replace(
        exp_line, "            if HAS_MAXIMA:\n                zmax = gl.max(acc, axis=1)\n" + exp_line
    ).replace(
        cur,
        "                gl.store(maxima_ptr + slot, gl.exp2(gl.fma(zmax, gl.full([BLOCK_M], LOG2E, gl.float32, row_layout), -(shift * LOG2E))), mask=row_ok)\n",
    ),
    "store": src.replace(cur, "                gl.store(maxima_ptr + slot, tile_sum, mask=row_ok)\n"),
}
mods = {}
for name, text in variants.items():
    path = f"/tmp/gvar_{name}.py"
    open(path, "w").write(text)
    spec = importlib.util.spec_from_file_location(f"gvar_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mods[name] = mod

for hidden, vocab in ((1024, 131072), (896, 151936), (2048, 128256)):
    n = 8192
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    w = (torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16, generator=g) * (4 / hidden**0.5)).to(
        torch.bfloat16
    )
    slab = torch.empty(n, vocab, device="cuda", dtype=torch.bfloat16)
    shift = torch.zeros(n, device="cuda")
    tiles = -(-vocab // 128)
    sums = torch.empty(tiles * n, device="cuda")
    maxima = torch.empty(tiles * n, device="cuda")
    redo = torch.zeros(1, device="cuda", dtype=torch.int32)
    runs = {"none": (mods["e_max"], None)} | {k: (m, maxima) for k, m in mods.items()}
    results = {}
    for k, (m, mx) in runs.items():
        m.launch_row_scaled_exp_gemm(x, w, slab, shift, sums, n, redo, mx)
        if mx is not None:
            results[k] = mx.clone()
    torch.cuda.synchronize()
    ref = results["e_max"]
    for k, r in results.items():
        diff = (r - ref).abs().max().item() if k != "store" else float("nan")
        print(
            f"  {k}: max |maxima - e_max's| {diff:.3g} (relative {((r - ref).abs() / ref.clamp_min(1e-30)).max().item():.3g})",
            flush=True,
        )
    times = {k: [] for k in runs}
    for _ in range(5):
        for k, (m, mx) in runs.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(5_000_000)
            a.record()
            for _ in range(20):
                m.launch_row_scaled_exp_gemm(x, w, slab, shift, sums, n, redo, mx)
            b.record()
            b.synchronize()
            times[k].append(a.elapsed_time(b) / 20)
    base = statistics.median(times["none"])
    print(
        f"== {n}x{hidden}x{vocab}: "
        + ", ".join(f"{k} {statistics.median(v):.3f} ms ({statistics.median(v) / base:.4f})" for k, v in times.items()),
        flush=True,
    )
    del x, w, slab, sums, maxima
    torch.cuda.empty_cache()
