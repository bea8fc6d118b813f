"""The field report's scenario on one GPU: the Gemma-4 31B head under ZeRO-3, its loss call at allocator saturation.

    python -m flce_policy.benchmarks.zero3_saturation OUT_DIR [--tokens 8192 12288] [--steps 3] [--wrapper auto]

The model is a transformers ``Gemma4ForCausalLM`` patched by ``apply_flce`` as a user's would be: a
one-layer body (two attention heads, a 512-wide MLP) under the Gemma-4 31B head, H=5376 and
V=262144, with its final-logit softcap 30 and its head tied to the embedding, as Gemma's config has
them. The head's weight is drawn so that its logits spread with std 4 (the bench's inputs): HF's own
initialisation gives them std 1.5 at H=5376, and 0.16 at the CPU run's H=64, where the softcap would
never act. Weights are fp32 and the step runs under bf16 autocast, so the loss computes in bf16 and
accumulates grad_weight in fp32 (the report's ``accum_dtype=fp32``); SGD at lr 0 keeps the weights,
so every step has the same loss.

``--wrapper zero3`` (the default where DeepSpeed is installed): a DeepSpeed ZeRO-3 engine that
partitions every parameter and releases each after its use (``stage3_max_reuse_distance=0``), so the
head is gathered for its own call and its gradient is reduced into its partition. ``--wrapper ddp``
(the default without DeepSpeed, said on the first line printed): the same model and steps under
one-rank DistributedDataParallel, the head whole on the device: the scenario without ZeRO-3's gather.

For each token count, in a child process (the last case's OOM leaves DeepSpeed mid-forward):

1. unconstrained: the packaged policy (the reference loss, also checked against plain torch fp32 on
   the head's own inputs), fixed 2048 rows (its head call's memory is measured), fixed 256 rows;
2. saturated: while the head computes its loss (from a forward pre-hook on ``lm_head``, after ZeRO-3
   gathered it, to its forward hook), a filler leaves free what the unconstrained 2048-row call needed
   less a quarter of its slab: 1024 rows fit, 2048 do not. Cases: fixed 256 and 1024 rows, the
   packaged policy (OOM fallback on), a ``free_memory`` policy, and last fixed 2048 rows with the
   fallback off, as a loss without one would run.

Reported per case: memory left at the call, the geometry that ran, the outcome, the loss against the
unconstrained run's, and step time (forward + backward + optimizer step). PASS when every case
completes with the unconstrained loss, but the saturated 2048 rows without a fallback, which must
run out of memory (as in the report), and when the saturated packaged policy runs at least the rows
of the largest fixed case that completed beside it (the largest rows that fit). Writes
``OUT_DIR/zero3_saturation.json``. The child runs with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``
unless it is set: with the default allocator the saturated call fails on fragments, whatever its rows
(docs/fsdp-zero3.md). On CPU (no GPU, or ``TRITON_INTERPRET=1``; gloo) it runs the same cases at
tiny shapes (tokens and rows / 64, V=512, H=64) without the filler, to check the plumbing.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

GIB = 1 << 30
#: Gemma-4 31B's head: its config's hidden_size, vocab_size and final_logit_softcapping
GEMMA4_31B_HIDDEN, GEMMA4_31B_VOCAB, GEMMA4_SOFTCAP = 5376, 262144, 30.0
#: The CPU run's head, and the divisor of its tokens and rows: the same cases at interpreter speed
CPU_HIDDEN, CPU_VOCAB, CPU_DIVISOR = 64, 512, 64
LOGIT_STD = 4.0
#: A case's loss against the unconstrained packaged policy's: the same model and inputs in other chunks
LOSS_RTOL = 1e-3
#: The packaged policy's loss against plain torch fp32: bf16 GEMM inputs, HF's eager bf16 softcap rounding
FP32_RTOL = 5e-3
#: Rows per chunk of the fp32 reference: a [1024, V] fp32 block (1 GiB at V=262144) at a time
REFERENCE_ROWS = 1024
#: The child's allocator, unless the caller sets one (the default allocator fails on fragments at saturation)
ALLOC_CONF = "expandable_segments:True"
WRAPPERS = ("zero3", "ddp")


def on_gpu() -> bool:
    return torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"


@dataclass(frozen=True)
class Scenario:
    """The shapes of one run: the report's on a GPU, small ones on CPU (tokens and rows / CPU_DIVISOR)."""

    cuda: bool
    tokens: int
    vocab: int
    hidden: int

    @classmethod
    def for_tokens(cls, cuda: bool, tokens: int) -> Scenario:
        if cuda:
            return cls(True, tokens, GEMMA4_31B_VOCAB, GEMMA4_31B_HIDDEN)
        return cls(False, max(1, tokens // CPU_DIVISOR), CPU_VOCAB, CPU_HIDDEN)

    def rows(self, report_rows: int) -> int:
        """The chunk rows standing for ``report_rows`` (the report's 256, 1024, 2048) at this scenario's scale."""
        return report_rows if self.cuda else max(1, report_rows // CPU_DIVISOR)


def make_model(s: Scenario, device: torch.device) -> torch.nn.Module:
    """A one-layer Gemma-4 body under the Gemma-4 31B head (tied, softcap 30), fp32, in train mode."""
    import transformers

    head_dim = 128 if s.cuda else 16
    config = transformers.Gemma4TextConfig(
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        intermediate_size=512 if s.cuda else 32,
        num_hidden_layers=1,
        layer_types=["full_attention"],  # Gemma-4's last layer is a full-attention one
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=head_dim,
        global_head_dim=head_dim,  # a full-attention layer's head_dim
        hidden_size_per_layer_input=0,  # no per-layer embeddings (the small Gemma-4s' [V, layers x 256] table)
        final_logit_softcapping=GEMMA4_SOFTCAP,
        tie_word_embeddings=True,
    )
    config._attn_implementation = "sdpa"  # not eager: no [T, T] scores per head at 8k tokens
    torch.manual_seed(0)
    with device:  # initialised where it lives: no 5.6 GB trip through the host
        model = transformers.Gemma4ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, LOGIT_STD / s.hidden**0.5)
    return model.train()


def make_batch(s: Scenario, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence of random token ids; its labels are the ids (HF shifts them: position t predicts t + 1)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, s.vocab, (1, s.tokens), generator=g).to(device)
    return ids, ids.clone()


def fp32_loss(hidden_states: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, softcap: float) -> float:
    """Plain torch fp32: HF's causal-LM loss of ``softcap * tanh(hidden_states @ weight.T / softcap)``,
    computed REFERENCE_ROWS rows at a time (no ``[T, V]`` logits at once)."""
    h = hidden_states.reshape(-1, hidden_states.shape[-1]).float()
    targets = F.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)
    w = weight.float()
    total = torch.zeros((), dtype=torch.float64, device=h.device)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad():
            for start in range(0, h.shape[0], REFERENCE_ROWS):
                rows = slice(start, start + REFERENCE_ROWS)
                logits = softcap * torch.tanh(h[rows] @ w.T / softcap)
                total += F.cross_entropy(logits, targets[rows], ignore_index=-100, reduction="sum").double()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return (total / (targets != -100).sum()).item()


class Saturate:
    """Holds a filler while ``lm_head`` runs, leaving ``leave`` bytes available to the loss call.

    Unsaturated (``leave`` None), it measures what the head's call needs (peak allocation from its
    pre-forward hook, which runs after ZeRO-3's gather, to its forward hook); saturated or not, it
    times the call between the hooks (CUDA events), so the filler's own allocation is not in the time.
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
        if self.leave is not None:
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


class HeadInput:
    """Keeps what ``lm_head`` was last given (the body's hidden states) while ``armed``: the fp32 reference's input."""

    def __init__(self, head: torch.nn.Module) -> None:
        self.armed = False
        self.hidden_states: torch.Tensor | None = None
        head.register_forward_pre_hook(self._keep)

    def _keep(self, module: torch.nn.Module, args: tuple) -> None:
        if self.armed:
            self.hidden_states = args[0].detach().clone()


class ZeRO3:
    """The model under a one-rank DeepSpeed ZeRO-3 engine: every parameter partitioned, released after its use."""

    name = "zero3"

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        import deepspeed

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
        self.wrapped, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        self.model = self.wrapped.module
        weight = self.model.lm_head.weight
        assert hasattr(weight, "ds_id") and weight.numel() == 0, "lm_head is not ZeRO-3-partitioned"

    def step(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self.wrapped(input_ids=ids, labels=labels).loss
        self.wrapped.backward(loss)
        self.wrapped.step()
        return loss.detach()

    @contextlib.contextmanager
    def head_weight(self) -> Iterator[torch.Tensor]:
        import deepspeed

        weight = self.model.lm_head.weight
        with deepspeed.zero.GatheredParameters([weight]):
            yield weight


class DDP:
    """The model under one-rank DistributedDataParallel and torch's autocast: the scenario without ZeRO-3's gather."""

    name = "ddp"

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        from torch.nn.parallel import DistributedDataParallel

        self.device = device
        self.model = model
        self.wrapped = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # as under ZeRO-3: the same loss every step

    def step(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = self.wrapped(input_ids=ids, labels=labels).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    @contextlib.contextmanager
    def head_weight(self) -> Iterator[torch.Tensor]:
        yield self.model.lm_head.weight


def chosen_wrapper(asked: str, has_deepspeed: bool) -> tuple[str, str]:
    """(the wrapper that runs, why): ``auto`` is ZeRO-3 where DeepSpeed is installed, else one-rank DDP."""
    if asked == "auto":
        if has_deepspeed:
            return "zero3", "DeepSpeed is installed"
        return "ddp", "DeepSpeed is not installed: the same model and steps under one-rank DDP, without ZeRO-3"
    if asked == "zero3" and not has_deepspeed:
        raise SystemExit("--wrapper zero3 needs DeepSpeed (pip install deepspeed); --wrapper ddp runs without it")
    return asked, "asked for"


def run_child(tokens: int, steps: int, wrapper: str) -> dict:
    from flce_policy import FLCEPolicy
    from flce_policy.benchmarks.sharded_heads import init_single_rank
    from flce_policy.call import autograd as flce_autograd
    from flce_policy.engine.probe import device_for_tensor_device
    from flce_policy.integrations.transformers import apply_flce
    from flce_policy.plan.oom import OOMFallbackWarning
    from flce_policy.strategies import FixedChunkSize, FreeMemory

    cuda = on_gpu()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    init_single_rank(cuda)
    s = Scenario.for_tokens(cuda, tokens)
    run = (ZeRO3 if wrapper == "zero3" else DDP)(make_model(s, device), device)
    saturate = Saturate(run.model.lm_head) if cuda else None
    head_input = HeadInput(run.model.lm_head)
    ids, labels = make_batch(s, device)
    autocast_copy = s.vocab * s.hidden * 2  # the bf16 copy of the fp32 head the call makes under autocast
    measured: dict[str, int] = {}

    ran: list = []
    original_run = flce_autograd.run_with_oom_fallback

    def spy(*args, **kwargs):  # the geometry that completed (after any OOM fallback)
        result = original_run(*args, **kwargs)
        ran.append(result[1])
        return result

    flce_autograd.run_with_oom_fallback = spy

    def case(name: str, policy, saturated: bool) -> dict:
        apply_flce(run.wrapped, policy=policy)
        if saturate is not None:
            saturate.leave = measured.get("leave") if saturated else None
            saturate.head_ms.clear()
            saturate.need = None  # this case's, not the last one's
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
                    loss = run.step(ids, labels)
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
                "slab_form": geo.slab_form,
                "slab_bytes": geo.slab_bytes,
                "slab_GiB": geo.slab_bytes / GIB,
            }
        if loss is not None and record["outcome"] == "completed":
            record["loss"] = loss.item()
            timed = times[1:] or times
            record["step_ms"] = 1e3 * sum(timed) / len(timed)
        return record

    def fixed(report_rows: int, fallback: bool = True) -> FLCEPolicy:
        return FLCEPolicy(default=FixedChunkSize(s.rows(report_rows)), oom_fallback=fallback)

    # reserve: the autocast copy of the head, allocated after the strategy reads free memory
    free_memory = FLCEPolicy(default=FreeMemory(fraction=0.5, reserve=autocast_copy + GIB // 4, accum_dtype="float32"))
    plan = [
        ("packaged policy", FLCEPolicy.default(), False),
        ("fixed 2048 rows", fixed(2048), False),
        ("fixed 256 rows", fixed(256), False),
        ("fixed 256 rows", fixed(256), True),
        ("fixed 1024 rows", fixed(1024), True),
        ("packaged policy (OOM fallback on)", FLCEPolicy.default(), True),
        ("free_memory(fraction=0.5, reserve=autocast copy+0.25GiB, accum fp32)", free_memory, True),
        ("fixed 2048 rows, no fallback", fixed(2048, fallback=False), True),  # last: an OOM leaves DeepSpeed mid-step
    ]
    if not cuda:  # free memory is only known on a GPU
        plan = [entry for entry in plan if entry[1] is not free_memory]
    records: list[dict] = []
    reference: dict = {}
    for name, policy, saturated in plan:
        try:
            if saturated and cuda and "leave" not in measured:
                raise RuntimeError("no measured need of the unconstrained 2048-row call to saturate against")
            head_input.armed = not records  # the first case's head input: the fp32 reference's
            records.append(case(name, policy, saturated))
            head_input.armed = False
            if name == "fixed 2048 rows" and not saturated and saturate is not None and saturate.need:
                # a quarter slab short of what the unconstrained 2048-row call needed: 1024 rows fit, 2048 do not
                slab = records[-1]["geometry"]["slab_bytes"]
                measured.update(need_2048=saturate.need, slab_2048=slab, leave=saturate.need - slab // 4)
        except Exception as e:
            records.append(
                {
                    "case": name,
                    "saturated": saturated,
                    "outcome": f"error: {type(e).__name__}: {e}",
                    "traceback": traceback.format_exc(),
                }
            )
        if head_input.hidden_states is not None:
            with run.head_weight() as weight:
                reference["fp32_loss"] = fp32_loss(head_input.hidden_states, weight, labels, GEMMA4_SOFTCAP)
            head_input.hidden_states = None
    flce_autograd.run_with_oom_fallback = original_run
    return {
        "tokens": s.tokens,
        "vocab": s.vocab,
        "hidden": s.hidden,
        "softcap": GEMMA4_SOFTCAP,
        "wrapper": wrapper,
        "device": repr(device_for_tensor_device(device)),
        "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") if cuda else None,
        "leave_GiB": measured["leave"] / GIB if "leave" in measured else None,
        "leave_from": "measured need of the unconstrained 2048-row call less a quarter of its slab",
        "need_2048_GiB": measured["need_2048"] / GIB if "need_2048" in measured else None,
        "fp32_reference_loss": reference.get("fp32_loss"),
        "cases": records,
    }


def verdict(result: dict, cuda: bool) -> list[tuple[bool, str]]:
    """One (ok, line) per case, then the packaged policy's loss against plain torch fp32."""
    cases = result["cases"]
    reference = next((c.get("loss") for c in cases if not c["saturated"] and c["case"] == "packaged policy"), None)
    # the largest rows that fit: the most rows among the saturated fixed cases that completed
    fitted = [
        c["geometry"]["chunk_size"]
        for c in cases
        if c["saturated"] and c["case"].startswith("fixed") and c["outcome"] == "completed" and "geometry" in c
    ]
    lines = []
    for c in cases:
        detail = f"{c['outcome']}"
        if "geometry" in c:
            g = c["geometry"]
            slab_mib = g["slab_bytes"] / 2**20
            detail += f", {g['num_chunks']} x {g['chunk_size']} rows ({g['slab_form']} slab {slab_mib:.4g} MiB)"
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
            ok = c["outcome"] == "completed" and c.get("loss_rel_diff_vs_unconstrained", 0.0) <= LOSS_RTOL
        if cuda and c["saturated"] and c["case"].startswith("packaged policy"):
            rows = c.get("geometry", {}).get("chunk_size", 0)
            largest = max(fitted, default=None)
            ok = ok and largest is not None and rows >= largest
            detail += f"; rows {rows} vs the largest fixed rows that fit: {largest}"
        label = f"{'saturated' if c['saturated'] else 'unconstrained'} {c['case']}"
        lines.append((ok, f"tokens={result['tokens']} {label}: {detail}" + (" (expected OOM)" if expect_oom else "")))
    fp32 = result.get("fp32_reference_loss")
    if reference is not None and fp32 is not None:
        diff = abs(reference - fp32) / abs(fp32)
        lines.append(
            (
                diff <= FP32_RTOL,
                f"tokens={result['tokens']} unconstrained packaged policy's loss {reference:.6f} vs plain torch fp32 "
                f"on the head's inputs {fp32:.6f}: rel diff {diff:.1e} (limit {FP32_RTOL})",
            )
        )
    else:
        lines.append((False, f"tokens={result['tokens']} no fp32 reference: the unconstrained packaged policy failed"))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 12288])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--wrapper", choices=("auto", *WRAPPERS), default="auto", help="zero3 (DeepSpeed), ddp, or auto (the first)"
    )
    parser.add_argument("--child-timeout", type=int, default=600, help="seconds for one token count's process")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.child is not None:
        result = run_child(args.child, args.steps, args.wrapper)
        (args.out / f"zero3_saturation_{args.child}.json").write_text(json.dumps(result, indent=1))
        sys.stdout.flush()
        os._exit(0)  # the last case's OOM left DeepSpeed mid-forward: no teardown that could wait on it
    cuda = on_gpu()
    wrapper, why = chosen_wrapper(args.wrapper, importlib.util.find_spec("deepspeed") is not None)
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)}
    print(
        f"wrapper {wrapper} ({why}); {'GPU' if cuda else 'CPU, tiny shapes, no filler'}; "
        f"PYTORCH_CUDA_ALLOC_CONF={env['PYTORCH_CUDA_ALLOC_CONF']}",
        flush=True,
    )
    results, failures = [], 0
    for tokens in args.tokens:  # one process each: the last case's OOM leaves DeepSpeed mid-forward
        path = args.out / f"zero3_saturation_{tokens}.json"
        path.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, str(args.out), "--child", str(tokens), "--steps", str(args.steps)]
        cmd += ["--wrapper", wrapper]
        try:
            proc = subprocess.run(cmd, timeout=args.child_timeout, capture_output=True, text=True, env=env)
        except subprocess.TimeoutExpired:
            print(f"FAIL tokens={tokens}: the child ran past {args.child_timeout} s")
            failures += 1
            continue
        (args.out / f"zero3_saturation_{tokens}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0 or not path.exists():
            print(f"FAIL tokens={tokens}: child exited {proc.returncode}\n{(proc.stdout + proc.stderr)[-3000:]}")
            failures += 1
            continue
        result = json.loads(path.read_text())
        leave = result["leave_GiB"]
        need = result["need_2048_GiB"]
        print(
            f"tokens={result['tokens']} V={result['vocab']} H={result['hidden']} softcap {result['softcap']} "
            f"{result['wrapper']}: leave "
            + (f"{leave:.3f} GiB ({result['leave_from']}: {need:.3f} GiB)" if leave is not None else "none (CPU)"),
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
