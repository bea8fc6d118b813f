"""Eager vs ``torch.compile`` of the loss: ``python -m flce_policy.benchmarks.compile_bench OUT.json [BTxHxV...]``.

For each shape (default 4096x1024x32768 and 8192x4096x128256, bf16, ~1% ignored targets), one
fwd+bwd of the loss (x and W needing grad) in four forms, measured in one run:

- ``eager``: ``fused_linear_cross_entropy`` as called in a training loop;
- ``compiled``: ``torch.compile(fullgraph=True)`` (inductor), the loss one custom-op node;
- ``reduce_overhead``: ``mode="reduce-overhead"``: fwd and bwd replayed as CUDA graphs;
- ``hf_eager`` / ``hf_compiled``: a two-layer Llama with ``apply_flce``, when transformers and
  the integration are installed (shape's H and V, 4 heads of 2 layers; a training step);
- ``liger_eager`` / ``liger_compiled``: Liger-Kernel's fused linear cross-entropy (C=16), when
  installed, eager and ``torch.compile`` (no ``fullgraph``): a peer's compiled / eager;
- ``scaled_eager`` / ``scaled_compiled``: the loss's eager and compiled steps with ``grad_output``
  0.5 (a loss divided for gradient accumulation, or scaled by a GradScaler): eager then scales the
  gradients too, which it skips when ``grad_output`` is 1 and the compiled backward cannot;
- ``trivial_eager`` / ``trivial_compiled``: a one-element fwd+bwd on the same tensors, whose
  difference is what ``torch.compile``'s own wrappers cost per call, whatever the function.

Per form: ``wall_ms`` (CUDA events around one step after a synchronize: GPU time plus the launch
latency the host adds), ``pipelined_ms`` (N back-to-back steps / N, the host free to run ahead:
a host-bound step shows here) and ``host_ms`` (time to issue one step), each the median of 5
rounds in which every form is measured in turn (so drift in clocks or the host hits all forms
alike). ``kernel_ms`` is the sum of the CUDA kernels' own time per step (torch.profiler) of the
eager loss; the ratios are each form's times over it and over its eager counterpart. Prints a
table and writes everything (every round's numbers too) to OUT.json.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch

from .measure import back_to_back_ms
from .methods import Inputs, make_inputs
from .profile_chunks import kernel_times, wall_and_host_ms
from .suite import parse_shape

DEFAULT_SHAPES = ("4096x1024x32768", "8192x4096x128256")
Step = Callable[[], None]


def kernel_ms(step: Step) -> float:
    """Summed CUDA kernel time per call of ``step`` (ms), from the profiler, after a warm-up."""
    return sum(kernel_times(step, repeats=5).values())


ROUNDS = 5  # every form is measured once per round, the rounds interleaved: drift hits all alike


def pipelined_ms(step: Step, steps: int) -> float:
    """Mean time of ``steps`` steps issued back to back from an idle GPU (the host free to run ahead), in ms."""
    torch.cuda.synchronize()
    return back_to_back_ms(step, steps)


def times_ms(forms: dict[str, Step], pipelined: int = 20) -> dict[str, dict[str, Any]]:
    """Per form: median over ROUNDS interleaved rounds of the synchronised wall time of one step, the
    host time to issue it, and the back-to-back mean; a form that fails is reported, not fatal."""
    results: dict[str, dict[str, Any]] = {}
    samples: dict[str, dict[str, list[float]]] = {}
    for name, step in forms.items():
        try:
            for _ in range(2):
                step()
            samples[name] = {"wall_ms": [], "host_ms": [], "pipelined_ms": []}
        except Exception as err:  # noqa: BLE001
            results[name] = {"error": f"{type(err).__name__}: {err}"}
    for _ in range(ROUNDS):
        for name, got in samples.items():
            wall, host = wall_and_host_ms(forms[name], repeats=5)
            got["wall_ms"].append(wall)
            got["host_ms"].append(host)
            got["pipelined_ms"].append(pipelined_ms(forms[name], pipelined))
    for name, got in samples.items():
        results[name] = {key: statistics.median(values) for key, values in got.items()}
        results[name]["rounds"] = got
    return {name: results[name] for name in forms}


def _leaf_step(
    fn: Callable[..., torch.Tensor],
    x: torch.Tensor,
    w: torch.Tensor,
    *rest: Any,
    graphs: bool = False,
    grad_output: torch.Tensor | None = None,
) -> Step:
    """One fwd+bwd of ``fn(x, w, *rest)`` with the leaves' gradients dropped after it (``graphs``: a
    CUDA-graph step begins; ``grad_output``: the backward's seed, 1 when None)."""

    def step() -> None:
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        fn(x, w, *rest).backward(grad_output)
        x.grad = None
        w.grad = None

    return step


def touch_steps(inputs: Inputs) -> dict[str, Step]:
    """A trivial fwd+bwd on the same tensors, eager and compiled: what torch.compile itself costs per call."""
    x = inputs.x.detach().requires_grad_()
    w = inputs.weight.detach().requires_grad_()

    def touch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x[:1].float().sum() + w[:1].float().sum()

    return {
        "trivial_eager": _leaf_step(touch, x, w),
        "trivial_compiled": _leaf_step(torch.compile(touch, fullgraph=True), x, w),
    }


def loss_steps(inputs: Inputs) -> dict[str, Step]:
    from flce_policy import fused_linear_cross_entropy

    x = inputs.x.detach().requires_grad_()
    w = inputs.weight.detach().requires_grad_()
    y = inputs.target

    def loss_of(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return fused_linear_cross_entropy(x, w, y)

    # Static addresses: CUDA graphs would otherwise copy x and W into their own buffers every
    # replay (a parameter-sized copy an nn.Parameter, which a real model passes, never pays).
    torch._dynamo.mark_static_address(x)
    torch._dynamo.mark_static_address(w)
    compiled = torch.compile(loss_of, fullgraph=True)
    half = torch.full((), 0.5, device=x.device)
    return {
        "eager": _leaf_step(loss_of, x, w, y),
        "compiled": _leaf_step(compiled, x, w, y),
        "reduce_overhead": _leaf_step(
            torch.compile(loss_of, fullgraph=True, mode="reduce-overhead"), x, w, y, graphs=True
        ),
        "scaled_eager": _leaf_step(loss_of, x, w, y, grad_output=half),
        "scaled_compiled": _leaf_step(compiled, x, w, y, grad_output=half),
    }


def peer_steps(inputs: Inputs) -> dict[str, Step]:
    """Liger-Kernel's fused linear cross-entropy (C=16), eager and compiled, when installed: how a peer's
    compiled / eager compares. Compiled without ``fullgraph`` (Dynamo traces its Python and Triton calls)."""
    if importlib.util.find_spec("liger_kernel") is None:
        print("liger rows skipped: liger_kernel is not installed")
        return {}
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    x = inputs.x.detach().requires_grad_()
    w = inputs.weight.detach().requires_grad_()
    y = inputs.target

    def loss_of(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return liger_fused_linear_cross_entropy(x, w, y, chunk_mem_const=16)

    return {"liger_eager": _leaf_step(loss_of, x, w, y), "liger_compiled": _leaf_step(torch.compile(loss_of), x, w, y)}


def hf_steps(tokens: int, hidden: int, vocab: int, device: str = "cuda") -> dict[str, Step]:
    """An apply_flce-patched two-layer Llama training step, eager and compiled; {} when unavailable.
    ``device``: the GPU, or the CPU of the smoke test."""
    try:
        import transformers

        from flce_policy.integrations.transformers import apply_flce  # type: ignore[attr-defined]
    except ImportError as err:
        print(f"hf rows skipped: {err}")
        return {}
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=max(1, hidden // 128), num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=tokens,
    )  # fmt: skip
    batch, seq = max(1, tokens // 2048), min(tokens, 2048)
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), device=device, generator=gen)
    steps = {}
    for name, compile_it in (("hf_eager", False), ("hf_compiled", True)):
        model = transformers.LlamaForCausalLM(config).to(device, torch.bfloat16)
        apply_flce(model)
        model.train()

        def forward(ids: torch.Tensor, model: Any = model) -> torch.Tensor:
            return model(input_ids=ids, labels=ids).loss

        fn = torch.compile(forward, fullgraph=True) if compile_it else forward

        def step(fn: Callable[..., torch.Tensor] = fn, model: Any = model) -> None:
            fn(ids).backward()
            model.zero_grad(set_to_none=True)

        steps[name] = step
    return steps


def run_shape(text: str) -> dict[str, Any]:
    tokens, hidden, vocab = parse_shape(text)
    inputs = make_inputs(tokens, hidden, vocab, logit_std=4.0)
    steps = loss_steps(inputs)
    record: dict[str, Any] = {"shape": text, "kernel_ms": kernel_ms(steps["eager"])}
    forms = {**steps, **peer_steps(inputs), **hf_steps(tokens, hidden, vocab), **touch_steps(inputs)}
    record["forms"] = times_ms(forms)
    from torch._dynamo.utils import counters

    record["cudagraph_skips"] = int(counters["inductor"]["cudagraph_skips"])  # a count
    kernels = record["kernel_ms"]
    for name, form in record["forms"].items():
        if "error" in form:
            continue
        form["wall_over_kernels"] = form["wall_ms"] / kernels
        form["pipelined_over_kernels"] = form["pipelined_ms"] / kernels
        family = name.rsplit("_", 1)[0] if name.startswith(("hf_", "trivial_", "liger_", "scaled_")) else ""
        reference = record["forms"].get(f"{family}_eager" if family else "eager")
        if reference and "error" not in reference:
            form["wall_over_eager"] = form["wall_ms"] / reference["wall_ms"]
            form["pipelined_over_eager"] = form["pipelined_ms"] / reference["pipelined_ms"]
    del inputs, steps
    torch.cuda.empty_cache()
    return record


def show(record: dict[str, Any]) -> None:
    print(f"--- {record['shape']}: {record['kernel_ms']:.3f} ms of kernels per eager step")
    columns = ("wall ms", "pipel. ms", "host ms", "wall/kern", "pipel/kern", "wall/eager")
    print(f"  {'form':<16}" + "".join(f"{c:>11}" for c in columns))
    for name, f in record["forms"].items():
        if "error" in f:
            print(f"  {name:<16}{f['error']}")
            continue
        keys = ("wall_ms", "pipelined_ms", "host_ms", "wall_over_kernels", "pipelined_over_kernels")
        values = [f[k] for k in keys] + [f.get("wall_over_eager", float("nan"))]
        print(f"  {name:<16}" + "".join(f"{v:11.3f}" for v in values))
    touch = record["forms"]
    if "error" not in touch["trivial_eager"] and "error" not in touch["trivial_compiled"]:
        fixed = touch["trivial_compiled"]["host_ms"] - touch["trivial_eager"]["host_ms"]
        print(f"  torch.compile's own host cost per fwd+bwd call (trivial function, compiled - eager): {fixed:.3f} ms")
    if record["cudagraph_skips"]:
        print(f"  cudagraph skips: {record['cudagraph_skips']}")


def main(argv: list[str]) -> None:
    if not argv or argv[0].startswith("-"):
        raise SystemExit("usage: python -m flce_policy.benchmarks.compile_bench OUT.json [BTxHxV ...]")
    out, shapes = argv[0], argv[1:] or list(DEFAULT_SHAPES)
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0)}
    records = []
    for text in shapes:
        records.append(run_shape(text))
        show(records[-1])
    with open(out, "w") as fh:
        json.dump({**meta, "shapes": records}, fh, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
