"""The field report's scenario on one GPU: a Gemma-shaped head under ZeRO-3, its loss call at allocator saturation.

    python benchmarks/zero3_saturation.py OUT_DIR [--tokens 8192 12288] [--steps 3]

A Gemma-4-31B-shaped LM head (V=262144, H=5376) is a ZeRO-3-partitioned ``lm_head`` of a head-only
model patched by ``apply_flce``; the hidden states (bf16, as a body would hand them over) are its
input. The head's weights are fp32 and the step runs under bf16 autocast, so the loss computes in bf16
and accumulates grad_weight in fp32 (the report's ``accum_dtype=fp32``; the gradient reaches the
partitioned parameter and DeepSpeed reduces it). For each token count, in a child process:

1. unconstrained: the packaged policy (the reference loss), fixed 2048 rows, fixed 256 rows;
2. saturated: while the head computes its loss (from a pre-forward hook on ``lm_head``, after ZeRO-3
   gathered it, to its forward hook), a filler leaves free exactly what the memory model
   (``flce_policy.plan.memory``) says the call holds beside its slab, plus the autocast bf16 copy of the
   head, plus 0.75 of a 2048-row slab: a 1024-row slab fits, a 2048-row one does not. Cases: fixed
   256 rows, the packaged policy (OOM fallback on), a ``free_memory`` policy, and last (it leaves
   DeepSpeed mid-forward) fixed 2048 rows with the fallback off, as a loss without one would run.

Reported per case: memory left at the call, the geometry that ran, the outcome, loss vs the
unconstrained run, and step time (forward + backward + ``engine.step``). Writes
``OUT_DIR/zero3_saturation.json``; prints PASS/FAIL lines. On CPU (no GPU, ``TRITON_INTERPRET=1``)
it runs tiny shapes without the filler, to check the plumbing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

GIB = 1 << 30


def dims(cuda: bool, tokens: int) -> tuple[int, int, int]:
    return (262144, 5376, tokens) if cuda else (512, 64, tokens // 64)


class HeadOnly(torch.nn.Module):
    """What apply_flce patches, reduced to the head: a config, ``get_output_embeddings``, HF's forward shape."""

    def __init__(self, vocab: int, hidden: int) -> None:
        from transformers import PretrainedConfig

        super().__init__()
        self.config = PretrainedConfig()
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head

    def forward(self, hidden_states: torch.Tensor, labels: torch.Tensor | None = None, **_: object):
        from transformers.modeling_outputs import CausalLMOutput

        return CausalLMOutput(logits=self.lm_head(hidden_states))


class Saturate:
    """Holds a filler while ``lm_head`` runs, leaving ``leave`` bytes available to the loss call.

    Unsaturated, it measures what the head's call needs (peak allocation from its pre-forward hook,
    which runs before ZeRO-3's gather, to its forward hook); saturated or not, it times the call
    between the hooks (CUDA events), so the filler's own allocation is not in the time.
    """

    def __init__(self, head: torch.nn.Module) -> None:
        self.leave: int | None = None
        self.filler: torch.Tensor | None = None
        self.left_at_call: int | None = None
        self.need: int | None = None
        self.head_ms: list[float] = []
        self._start_alloc = 0
        self._events: tuple | None = None
        head.register_forward_pre_hook(self._fill)
        head.register_forward_hook(self._free)

    def _fill(self, module: torch.nn.Module, args: object) -> None:
        from flce_policy.engine.probe import device_for_tensor_device
        from flce_policy.plan.memory_now import available_bytes

        device = device_for_tensor_device(torch.device("cuda", torch.cuda.current_device()))
        if self.leave is None:
            self.left_at_call = available_bytes(device)
        else:
            torch.cuda.empty_cache()  # the filler takes device memory, the cache holds no fragments
            excess = available_bytes(device) - self.leave
            if excess > 0:
                self.filler = torch.empty(excess, dtype=torch.uint8, device="cuda")
            self.left_at_call = available_bytes(device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self._start_alloc = torch.cuda.memory_allocated()
        self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        self._events[0].record()

    def _free(self, *_: object) -> None:
        self._events[1].record()
        self._events[1].synchronize()
        self.head_ms.append(self._events[0].elapsed_time(self._events[1]))
        self.need = torch.cuda.max_memory_allocated() - self._start_alloc
        self.filler = None


def run_child(tokens: int, steps: int, out: Path) -> dict:
    import deepspeed

    from flce_policy import FLCEPolicy
    from flce_policy.benchmarks.sharded_heads import init_single_rank
    from flce_policy.call import autograd as flce_autograd
    from flce_policy.engine.probe import device_for_tensor_device
    from flce_policy.integrations.transformers import apply_flce
    from flce_policy.plan.memory import held_beside_slab
    from flce_policy.plan.oom import OOMFallbackWarning
    from flce_policy.plan.problem import Problem
    from flce_policy.strategies import FixedChunkSize, FreeMemory

    cuda = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    init_single_rank(cuda)
    vocab, hidden, tokens = dims(cuda, tokens)
    problem = Problem(tokens=tokens, hidden=hidden, vocab=vocab, dtype="bfloat16")
    slab_2048 = min(2048, tokens) * vocab * 2
    autocast_copy = vocab * hidden * 2  # the bf16 copy of the fp32 head the call makes under autocast
    # The filler is taken in a pre-forward hook registered before DeepSpeed's, so ZeRO-3's gather
    # of the fp32 head comes out of what is left too (run 1 on the H200 left it out: every case
    # then failed on the 5.25 GiB fp32 gradient, whatever the chunk).
    gathered_head = vocab * hidden * 4
    leave = held_beside_slab(problem, accum_dtype="float32") + autocast_copy + gathered_head + int(0.75 * slab_2048)
    # Run 2 on the H200 showed that model generous (every chunk fitted): on a GPU the leave is set
    # from the measured need of the unconstrained 2048-row call instead, a quarter slab short of it.
    measured: dict[str, int] = {}

    torch.manual_seed(0)
    with device:  # initialised where it lives: no 5.6 GB trip through the host
        model = HeadOnly(vocab, hidden)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 0,
            "reduce_bucket_size": 50_000_000,
        },
        # fp32 weights, bf16 compute: DeepSpeed's own autocast (it switches off an autocast opened outside it)
        "torch_autocast": {"enabled": True, "dtype": "bfloat16"},
        "zero_allow_untested_optimizer": True,
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # weights stay put: every step has the same loss
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    weight = engine.module.lm_head.weight
    assert hasattr(weight, "ds_id") and weight.numel() == 0, "lm_head is not ZeRO-3-partitioned"
    saturate = Saturate(engine.module.lm_head) if cuda else None

    g = torch.Generator().manual_seed(1)
    hidden_states = torch.randn(1, tokens, hidden, generator=g).to(device, torch.bfloat16).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens), generator=g).to(device)

    ran: list = []
    original_run = flce_autograd.run_with_oom_fallback

    def spy(*args, **kwargs):  # the geometry that completed (after any OOM fallback)
        result = original_run(*args, **kwargs)
        ran.append(result[1])
        return result

    flce_autograd.run_with_oom_fallback = spy

    def case(name: str, policy, saturated: bool) -> dict:
        apply_flce(engine, policy=policy)
        if saturate is not None:
            saturate.leave = measured.get("leave", leave) if saturated else None
            saturate.head_ms.clear()
        ran.clear()
        record: dict = {"case": name, "saturated": saturated}
        times, loss = [], None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", OOMFallbackWarning)
            try:
                for _ in range(steps):
                    if cuda:
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    with torch.autocast(device.type, dtype=torch.bfloat16):
                        loss = engine(hidden_states=hidden_states, labels=labels).loss
                    engine.backward(loss)
                    engine.step()
                    hidden_states.grad = None
                    if cuda:
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                record["outcome"] = "completed"
            except torch.cuda.OutOfMemoryError as e:
                record["outcome"] = "OOM"
                record["error"] = str(e).splitlines()[0][:300]
            finally:
                if saturate is not None:
                    saturate.filler = None
        fallbacks = [w for w in caught if issubclass(w.category, OOMFallbackWarning)]
        record["oom_fallback_warnings"] = [str(w.message)[:300] for w in fallbacks]
        if saturate is not None:
            record["memory_left_at_call_GiB"] = saturate.left_at_call / GIB
            if saturate.need is not None:
                record["head_call_need_GiB"] = saturate.need / GIB
            timed_head = saturate.head_ms[1:] or saturate.head_ms
            if timed_head and record["outcome"] == "completed":
                record["head_call_ms"] = sum(timed_head) / len(timed_head)
        if ran:
            geo = ran[-1]
            record["geometry"] = {
                "chunk_size": geo.chunk_size,
                "num_chunks": geo.num_chunks,
                "vocab_chunk": geo.vocab_chunk,
                "slab_GiB": geo.slab_bytes / GIB,
            }
        if loss is not None and record["outcome"] == "completed":
            record["loss"] = loss.item()
            timed = times[1:] or times
            record["step_ms"] = 1e3 * sum(timed) / len(timed)
        return record

    def fixed(rows: int, fallback: bool = True) -> FLCEPolicy:
        return FLCEPolicy(default=FixedChunkSize(rows), oom_fallback=fallback)

    # reserve: the autocast copy of the head, allocated after the strategy reads free memory
    free_memory = FLCEPolicy(default=FreeMemory(fraction=0.5, reserve=autocast_copy + GIB // 4, accum_dtype="float32"))
    plan = [
        ("packaged policy", FLCEPolicy.default(), False),
        ("fixed 2048 rows", fixed(2048), False),
        ("fixed 256 rows", fixed(256), False),
        ("fixed 256 rows", fixed(256), True),
        ("packaged policy (OOM fallback on)", FLCEPolicy.default(), True),
        ("free_memory(fraction=0.5, reserve=autocast copy+0.25GiB, accum fp32)", free_memory, True),
        ("fixed 2048 rows, no fallback", fixed(2048, fallback=False), True),  # last: an OOM leaves DeepSpeed mid-step
    ]
    if not cuda:  # free memory is only known on a GPU
        plan = [entry for entry in plan if entry[1] is not free_memory]
    records = []
    for name, policy, saturated in plan:
        if saturated and saturate is not None and "leave" not in measured and "need_2048" in measured:
            measured["leave"] = measured["need_2048"] - slab_2048 // 4
        try:
            records.append(case(name, policy, saturated))
            if name == "fixed 2048 rows" and not saturated and saturate is not None and saturate.need:
                measured["need_2048"] = saturate.need
        except Exception as e:
            records.append(
                {
                    "case": name,
                    "saturated": saturated,
                    "outcome": f"error: {type(e).__name__}: {e}",
                    "traceback": traceback.format_exc(),
                }
            )
    flce_autograd.run_with_oom_fallback = original_run
    return {
        "tokens": tokens,
        "vocab": vocab,
        "hidden": hidden,
        "device": repr(device_for_tensor_device(device)),
        "leave_GiB": measured.get("leave", leave) / GIB if cuda else None,
        "leave_from": "measured need of the unconstrained 2048-row call less a quarter slab"
        if "leave" in measured
        else "memory model",
        "need_2048_GiB": measured["need_2048"] / GIB if "need_2048" in measured else None,
        "leave_terms_GiB": {
            "held_beside_slab_fp32_accum": held_beside_slab(problem, accum_dtype="float32") / GIB,
            "autocast_bf16_head": autocast_copy / GIB,
            "gathered_fp32_head": gathered_head / GIB,
            "0.75_slab_2048": 0.75 * slab_2048 / GIB,
        },
        "cases": records,
    }


def verdict(result: dict, cuda: bool) -> list[tuple[bool, str]]:
    cases = result["cases"]
    reference = next((c.get("loss") for c in cases if not c["saturated"] and c["case"] == "packaged policy"), None)
    lines = []
    for c in cases:
        detail = f"{c['outcome']}"
        if "geometry" in c:
            g = c["geometry"]
            detail += f", {g['num_chunks']} x {g['chunk_size']} rows (slab {g['slab_GiB']:.3f} GiB)"
        if "memory_left_at_call_GiB" in c:
            detail += f", left at call {c['memory_left_at_call_GiB']:.2f} GiB"
        if "step_ms" in c:
            detail += f", {c['step_ms']:.1f} ms/step"
        if "head_call_ms" in c:
            detail += f" (head call {c['head_call_ms']:.1f} ms)"
        if c.get("loss") is not None and reference is not None:
            c["loss_rel_diff_vs_unconstrained"] = abs(c["loss"] - reference) / abs(reference)
            detail += f", loss rel diff {c['loss_rel_diff_vs_unconstrained']:.1e}"
        expect_oom = cuda and c["saturated"] and "no fallback" in c["case"]
        if expect_oom:
            ok = c["outcome"] == "OOM"
        else:
            ok = c["outcome"] == "completed" and c.get("loss_rel_diff_vs_unconstrained", 0.0) <= 1e-3
        label = f"{'saturated' if c['saturated'] else 'unconstrained'} {c['case']}"
        lines.append((ok, f"tokens={result['tokens']} {label}: {detail}" + (" (expected OOM)" if expect_oom else "")))
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 12288])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.child is not None:
        result = run_child(args.child, args.steps, args.out)
        (args.out / f"zero3_saturation_{args.child}.json").write_text(json.dumps(result, indent=1))
        sys.stdout.flush()
        os._exit(0)  # the last case's OOM left DeepSpeed mid-forward: no teardown that could wait on it
    cuda = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
    results, failures = [], 0
    for tokens in args.tokens:  # one process each: the last case's OOM leaves DeepSpeed mid-forward
        path = args.out / f"zero3_saturation_{tokens}.json"
        cmd = [sys.executable, __file__, str(args.out), "--child", str(tokens), "--steps", str(args.steps)]
        try:
            proc = subprocess.run(cmd, timeout=240, capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            print(f"FAIL tokens={tokens}: the child ran past 240 s")
            failures += 1
            continue
        (args.out / f"zero3_saturation_{tokens}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0 or not path.exists():
            print(f"FAIL tokens={tokens}: child exited {proc.returncode}\n{(proc.stdout + proc.stderr)[-3000:]}")
            failures += 1
            continue
        result = json.loads(path.read_text())
        print(
            f"tokens={tokens} V={result['vocab']} H={result['hidden']}: leave "
            f"{result['leave_GiB'] if result['leave_GiB'] is None else round(result['leave_GiB'], 3)} GiB "
            f"({result['leave_from']}; need of 2048 rows {result['need_2048_GiB']}) "
            f"{result['leave_terms_GiB']}",
            flush=True,
        )
        for ok, line in verdict(result, cuda):
            print(f"{'PASS' if ok else 'FAIL'} {line}", flush=True)
            failures += not ok
        results.append(result)
    (args.out / "zero3_saturation.json").write_text(json.dumps(results, indent=1))
    print(f"{'PASS' if not failures else 'FAIL'} zero3_saturation: {failures} failing line(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
