# ruff: noqa
"""Session 20 probe (issue 26): where the row-scaled finish's filter flags spend their 40-90 us per chunk.

Variants of kernels/row_scaled_finish.py (patched copies imported from /tmp), each timed by the profiler's kernel
time over 20 launches on partials of random values, at 8192 rows x 1024 slots (V 131072, 128-column slots) and
4096 x 1187 (V 151936):
  nofilter   no flags
  filter     the current flags, row-major bytes ([rows, groups])
  gm         the same bytes stored group-major ([groups, rows]: a block's 16 rows side by side)
  nostore    the flags computed, their store masked off at run time (rows < 0)
  keeponly   only the kept bit stored (no levels: no log2, no ceil)
Run: PYTHONPATH=/tmp/site python3 this.py /tmp/site/flce_policy/kernels/row_scaled_finish.py
"""

import importlib.util, sys, collections
import torch
from flce_policy.kernels.ce_kernel import ce_workspace

src = open(sys.argv[1]).read().replace("from .", "from flce_policy.kernels.")
store = "tl.store(flags_ptr + rows.to(tl.int64)[None, :] * flag_row_stride + groups[:, None], codes, mask=mask)"
assert store in src
codes = "codes = flag_codes(keep & live[None, :], log2_top, filter_log2_eps)"
assert codes in src
variants = {
    "filter": src,
    "gm": src.replace(
        store, "tl.store(flags_ptr + groups.to(tl.int64)[:, None] * flag_row_stride + rows[None, :], codes, mask=mask)"
    ),
    "nostore": src.replace(store, store.replace("mask=mask)", "mask=mask & (rows < 0)[None, :])")),
    "keeponly": src.replace(codes, "codes = (keep & live[None, :]).to(tl.uint8)"),
}
mods = {}
for name, text in variants.items():
    path = f"/tmp/fvar_{name}.py"
    open(path, "w").write(text)
    spec = importlib.util.spec_from_file_location(f"fvar_{name}", path)
    mods[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mods[name])

for rows, vocab in ((8192, 131072), (4096, 151936)):
    ws = ce_workspace(rows, vocab, torch.device("cuda"), scaled_exp=True, slot_cols=128)
    ws.partials.uniform_(0.5, 2.0)
    ws.row_shift.uniform_(-1, 1)
    target = torch.randint(0, vocab, (rows,), device="cuda")
    loss_rows = torch.empty(rows, device="cuda")
    scale = torch.ones(2, device="cuda")
    groups = -(-vocab // 128)
    flags_rm = torch.empty(rows, groups, dtype=torch.uint8, device="cuda")
    flags_gm = torch.empty(groups, rows, dtype=torch.uint8, device="cuda")
    runs = {"nofilter": (mods["filter"], None)} | {k: (m, flags_gm if k == "gm" else flags_rm) for k, m in mods.items()}
    out = {}
    for k, (m, flags) in runs.items():
        call = lambda: m.row_scaled_finish(
            target,
            loss_rows,
            ws,
            n_cols=vocab,
            ignore_index=-100,
            grad_scale=scale,
            filter_flags=flags,
            filter_eps=2.0**-14,
        )
        call()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                call()
            torch.cuda.synchronize()
        t = [
            e.device_time
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and "finish" in e.name
        ]
        out[k] = sum(t) / len(t)
    print(f"== {rows} rows x {groups} slots: " + ", ".join(f"{k} {v:.1f} us" for k, v in out.items()), flush=True)
