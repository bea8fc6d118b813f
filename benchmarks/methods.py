"""The methods the suite compares; each builds a fwd+bwd step over shared inputs.

A method's ``build`` returns a zero-argument step, or raises :class:`Unavailable` with the
reason (peer not installed, not enough memory) so the row says why it is missing. Our rows and
Liger's carry a ``plan``: the chunk geometry they run (ours) or whose chunk rule they share
(Liger's ``chunk_mem_const``), from which :func:`predicted_peak` gives the memory model's answer.
"""

from __future__ import annotations

import fnmatch
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from flce_policy.plan.cost_model import predict_seconds, rates_for
from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.memory import predict_peak
from flce_policy.plan.problem import Problem
from flce_policy.plan.units import parse_bytes

if TYPE_CHECKING:
    from flce_policy.engine.policy import FLCEPolicy
    from flce_policy.strategies import ChunkStrategy

__all__ = [
    "FIXED_FAMILIES",
    "FLOOR",
    "OVERLAP_FAMILY",
    "PEER_DEFAULTS",
    "Inputs",
    "Method",
    "Unavailable",
    "default_methods",
    "fixed_chunk_methods",
    "make_inputs",
    "overlap_chunk_methods",
    "planned_vocab_chunk",
    "predicted_peak",
    "select_methods",
]

Step = Callable[[], None]
#: A loss method at given inputs: (x, weight) -> the scalar loss, differentiable in both.
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: The chunk geometry of a method for a (problem, device).
Plan = Callable[[Problem, DeviceInfo], Geometry]
#: The name of the reference row every ratio is taken against.
FLOOR = "gemm_floor"
#: Each peer's rows at its own defaults: Liger's chunk rule at C=1 (bf16, and with fp32 accumulation
#: for the fp32 comparison), QuACK at its default chunk, CCE with its default filter, eager PyTorch.
PEER_DEFAULTS = frozenset({"liger_c1_bf16", "liger_c1_fp32", "quack", "cce", "eager"})
#: The rows' grad_weight accumulation: the label and the loss's ``accum_dtype``.
_ACCUM_DTYPES: dict[str, torch.dtype | None] = {"bf16": None, "fp32": torch.float32}
#: The grad_weight filters benched: eps = 2^-12 and 2^-16 (issue 26's two), and two between them (the trade-off).
FILTER_EXPONENTS = (12, 13, 14, 16)
#: The rescued filters benched, (eps exponent, N): a skipped tile kept one in 2^L by its level L <= log2(N)
#: (unbiased). Priced on the trained inputs (H200, 2026-12-02, benchmarks/rescue_schemes.py): multiplied share /
#: grad_weight error over the dense call's 26% / 1.25x, 32% / 1.13x, 39% / 1.06x, 48% / 1.03x, 24% / 1.34x. 2^-13.5:
#: between 2^-13 (0.836x the floor at 1.14x the dense error on one chunk, results/2026-12-03-h200-trained-filters)
#: and 2^-14 (0.860x at 1.07x).
RESCUED_FILTERS = ((12, 16), (13, 16), (13.5, 16), (14, 16), (14, 4), (12, 256))
#: The family of the fixed-chunk rows on each slab form (tune chooses among them).
FIXED_FAMILIES = {
    "logits": "ours fixed",
    "scaled_exp": "ours fixed scaled-exp",
    "scaled_exp_rows": "ours fixed scaled-exp rows",
    "scaled_exp_ws": "ours fixed scaled-exp ws",
}
#: The family of the fixed-chunk rows in the form the engine chooses.
AUTO_FAMILY = "ours fixed auto"
#: The family of the fixed logits-slab rows with grad_weight's GEMM on a side stream (Geometry.overlap_weight_grad).
OVERLAP_FAMILY = "ours fixed overlap"
#: The softcap of the ``*_softcap*`` rows: Gemma 2's and Gemma 4's ``final_logit_softcapping``.
SOFTCAP = 30.0
#: The peak limit of the lean Fastest row: under liger-kernel fp32 (8.20 GiB at 32768x5376x262144)
#: by 5 GiB, and within it the two bf16 gradients (2.95 GiB there) and a 256 MiB slab.
LEAN_PEAK = "3276MiB"


class Unavailable(Exception):
    """A method cannot run here; the message says why."""


@dataclass
class Inputs:
    x: torch.Tensor  # [BT, H]
    weight: torch.Tensor  # [V, H]
    target: torch.Tensor  # [BT]

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.x.shape[0], self.x.shape[1], self.weight.shape[0])


def make_inputs(
    tokens: int, hidden: int, vocab: int, *, logit_std: float, dtype=torch.bfloat16, seed=0, device="cuda"
) -> Inputs:
    """x ~ N(0, 1), W scaled so x @ W.T has std ``logit_std``; ~1% of targets ignored. ``device``: the
    benchmarks' GPU, or the CPU of their smoke tests."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, device=device, generator=gen, dtype=dtype)
    weight = torch.randn(vocab, hidden, device=device, generator=gen, dtype=dtype) * (logit_std / hidden**0.5)
    target = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
    target[torch.rand(tokens, device=device, generator=gen) < 0.01] = -100
    return Inputs(x, weight, target)


def _leaf_step(inputs: Inputs, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Step:
    """fwd+bwd with x and W requiring grad; gradients dropped after each call."""
    x = inputs.x.detach().requires_grad_()
    weight = inputs.weight.detach().requires_grad_()

    def step() -> None:
        loss = loss_fn(x, weight)
        loss.backward()
        x.grad = None
        weight.grad = None

    return step


@dataclass(frozen=True)
class Method:
    """One row of the benchmark: ``family`` groups rows in the plot, ``chunk_size`` when fixed.

    ``accum`` is the grad_weight accumulation ("bf16": the weight dtype, "fp32"); ``plan`` the
    chunk geometry the row runs or mirrors, None for rows the memory model does not describe.
    """

    name: str
    family: str
    #: inputs -> the loss function ``(x, weight) -> scalar`` of a loss method (None for the floor)
    loss: Callable[[Inputs], LossFn] | None = None
    #: inputs -> a step of its own, for rows that are not a loss (the floor)
    step: Callable[[Inputs], Step] | None = None
    chunk_size: int | None = None
    accum: str = "bf16"
    options: dict[str, Any] = field(default_factory=dict)
    plan: Plan | None = None

    def build(self, inputs: Inputs) -> Step:
        """The fwd+bwd step timed for this row (Unavailable when it cannot run here)."""
        if self.step is not None:
            return self.step(inputs)
        assert self.loss is not None, f"{self.name}: a method needs a loss or a step"
        return _leaf_step(inputs, self.loss(inputs))


def gemm_floor(inputs: Inputs) -> Step:
    """x @ W.T, G @ W, G.T @ x with cuBLAS: what any logits-materialising FLCE must run."""
    x, weight = inputs.x, inputs.weight
    tokens, vocab = x.shape[0], weight.shape[0]
    logits = torch.empty(tokens, vocab, device=x.device, dtype=x.dtype)
    grad_logits = torch.randn(tokens, vocab, device=x.device, dtype=x.dtype)
    grad_x, grad_w = torch.empty_like(x), torch.empty_like(weight)

    def step() -> None:
        torch.mm(x, weight.t(), out=logits)
        torch.mm(grad_logits, weight, out=grad_x)
        torch.mm(grad_logits.t(), x, out=grad_w)

    return step


def ours(
    policy_factory: Callable[[Inputs], Any], accum_dtype: torch.dtype | None = None, **options: Any
) -> Callable[[Inputs], LossFn]:
    """Our loss under ``policy_factory(inputs)``, with loss ``options`` (e.g. ``grad_weight_filter``)."""

    def build(inputs: Inputs) -> LossFn:
        from flce_policy import fused_linear_cross_entropy

        policy = policy_factory(inputs)
        return lambda x, w: fused_linear_cross_entropy(
            x, w, inputs.target, policy=policy, accum_dtype=accum_dtype, **options
        )

    return build


def liger(
    chunk_mem_const: int, accum_dtype: torch.dtype | None = None, softcap: float | None = None
) -> Callable[[Inputs], LossFn]:
    def build(inputs: Inputs) -> LossFn:
        if importlib.util.find_spec("liger_kernel") is None:
            raise Unavailable("not installed")
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        return lambda x, w: liger_fused_linear_cross_entropy(
            x, w, inputs.target, chunk_mem_const=chunk_mem_const, accum_dtype=accum_dtype, softcap=softcap
        )

    return build


def cce(filter_eps: str | None = "auto") -> Callable[[Inputs], LossFn]:
    def build(inputs: Inputs) -> LossFn:
        if importlib.util.find_spec("cut_cross_entropy") is None:
            raise Unavailable("not installed")
        from cut_cross_entropy import linear_cross_entropy

        return lambda x, w: linear_cross_entropy(x, w, inputs.target, filter_eps=filter_eps, ignore_index=-100)

    return build


def quack(chunk_size: int = 4096) -> Callable[[Inputs], LossFn]:
    """QuACK's ``chunked_linear_cross_entropy`` (quack-kernels, CuTe-DSL) at its default chunk of 4096 rows."""

    def build(inputs: Inputs) -> LossFn:
        if importlib.util.find_spec("quack") is None:
            raise Unavailable("not installed")
        from quack.linear_cross_entropy import chunked_linear_cross_entropy

        return lambda x, w: chunked_linear_cross_entropy(
            x, w, inputs.target, chunk_size=chunk_size, ignore_index=-100, reduction="mean"
        )

    return build


def eager(inputs: Inputs) -> LossFn:
    tokens, vocab = inputs.shape[0], inputs.shape[2]
    # bf16 logits + their fp32 copy + the fp32 softmax gradient + its bf16 cast
    need = tokens * vocab * (2 + 4 + 4 + 2)
    free, _ = torch.cuda.mem_get_info()
    if need > 0.8 * free:
        raise Unavailable(f"needs ~{need / 2**30:.0f} GiB of logits, {free / 2**30:.0f} GiB free")
    return lambda x, w: F.cross_entropy((x @ w.t()).float(), inputs.target)


def _fixed_strategy(chunk: int | None, tokens: int) -> ChunkStrategy:
    """FixedChunkSize(chunk), or one chunk of all ``tokens`` rows when ``chunk`` is None."""
    from flce_policy.strategies import FixedChunkSize

    return FixedChunkSize(chunk or tokens)


def _fixed_for_inputs(chunk: int | None, slab_form: str | None, inputs: Inputs) -> Any:
    """The fixed chunk in ``slab_form`` (pinned, where it runs; None: the form the engine chooses)."""
    from flce_policy import FLCEPolicy

    strategy = _fixed_strategy(chunk, inputs.shape[0])
    return strategy if slab_form is None else FLCEPolicy(default=strategy, slab_form=slab_form)


def _fixed_plan(chunk: int | None, slab_form: str | None, problem: Problem, device: DeviceInfo) -> Geometry:
    from flce_policy.engine.planned import planned_geometry

    return planned_geometry(_fixed_strategy(chunk, problem.tokens), problem, device, slab_form=slab_form)


def fixed_chunk_methods(chunk_sizes: tuple[int, ...], accum: str, slab_form: str | None = "logits") -> list[Method]:
    """Our loss at each of ``chunk_sizes`` and at one chunk of all rows, on ``slab_form``'s slab (pinned), with
    ``accum``'s grad_weight accumulation: the rows ``ours_chunk{N}_{accum}`` / ``ours_one_chunk_{accum}`` (family
    ``ours fixed``), or ``ours_scaled_exp_chunk{N}_{accum}`` ... (family ``ours fixed scaled-exp``), and so on
    (:data:`FIXED_FAMILIES`); with ``slab_form=None`` ``ours_auto_chunk{N}_{accum}`` ..., the form the engine
    chooses for those rows (family ``ours fixed auto``)."""
    if slab_form is None:
        family, prefix = AUTO_FAMILY, "ours_auto_"
    else:
        family, prefix = FIXED_FAMILIES[slab_form], "ours_" if slab_form == "logits" else f"ours_{slab_form}_"
    methods = []
    for chunk in (*chunk_sizes, None):
        label = "one_chunk" if chunk is None else f"chunk{chunk}"
        methods.append(
            Method(
                f"{prefix}{label}_{accum}",
                family,
                ours(partial(_fixed_for_inputs, chunk, slab_form), _ACCUM_DTYPES[accum]),
                chunk_size=chunk,
                accum=accum,
                plan=partial(_fixed_plan, chunk, slab_form),
            )
        )
    return methods


def _overlap_plan(chunk: int, problem: Problem, device: DeviceInfo) -> Geometry:
    """The fixed logits-slab row's geometry at ``chunk`` rows, grad_weight's GEMM on a side stream."""
    return _fixed_plan(chunk, "logits", problem, device).with_overlap_weight_grad()


def _overlap_for_inputs(chunk: int, inputs: Inputs) -> Geometry:
    tokens, hidden, vocab = inputs.shape
    return _overlap_plan(chunk, Problem(tokens, hidden, vocab, dtype=inputs.x.dtype), DeviceInfo.cpu())


def overlap_chunk_methods(chunk_sizes: tuple[int, ...]) -> list[Method]:
    """The rows ``ours_overlap_chunk{N}_bf16`` (family :data:`OVERLAP_FAMILY`): ``ours_chunk{N}_bf16``'s geometry
    with each chunk's grad_weight GEMM beside its grad_input GEMM on a second CUDA stream. No one-chunk row: its
    only grad_weight GEMM writes once (beta=0), with no read-modify-write of [V, H] to hide."""
    return [
        Method(
            f"ours_overlap_chunk{chunk}_bf16",
            OVERLAP_FAMILY,
            ours(partial(_overlap_for_inputs, chunk)),
            chunk_size=chunk,
            plan=partial(_overlap_plan, chunk),
        )
        for chunk in chunk_sizes
    ]


def _vocab_tiled_plan(vocab_chunk: int, problem: Problem, device: DeviceInfo) -> Geometry:
    """One row chunk of all BT rows, vocab tiles of ``vocab_chunk`` (capped at V)."""
    return Geometry.for_problem(problem, problem.tokens, vocab_chunk=min(vocab_chunk, problem.vocab))


def _vocab_tiled_for_inputs(vocab_chunk: int, inputs: Inputs) -> Geometry:
    tokens, hidden, vocab = inputs.shape
    problem = Problem(tokens, hidden, vocab, dtype=inputs.x.dtype)
    return _vocab_tiled_plan(vocab_chunk, problem, DeviceInfo.cpu())


def scaled_exp_policy(policy: Any, *, rows: bool = False, warp_specialised: bool = False) -> Any:
    """``policy`` with every rule's strategy (and the default's) wrapped in ``scaled_exp`` where it is not already,
    each with ``rows`` (the row-scaled form where the call allows) and ``warp_specialised`` (its Gluon GEMM)."""
    from flce_policy import FLCEPolicy
    from flce_policy.engine.config import RULE_KEYS

    rule_only = set(RULE_KEYS) - {"strategy"}  # the rest of an entry is its strategy's
    config = policy.to_dict()
    for entry in (config["default"], *config["devices"]):
        if entry.get("strategy") != "scaled_exp":  # (the packaged H200 rule is already)
            inner = {key: entry.pop(key) for key in list(entry) if key not in rule_only}
            entry["strategy"] = "scaled_exp"
            entry["inner"] = inner
        entry["rows"] = rows
        entry["warp_specialised"] = warp_specialised
        entry.pop("ws_max_hidden", None)  # (the form asked for at every hidden size, chunked by the inner rule)
        entry.pop("ws_inner", None)
    form = "the row-scaled form" if rows else "the scaled-exp slab"
    form = "the warp-specialised row-scaled form" if warp_specialised else form
    return FLCEPolicy.from_dict(config, source=f"{policy.source}, each strategy on {form}")


def default_methods(
    chunk_sizes: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192),
    *,
    policy: FLCEPolicy | None = None,
    vocab_chunks: tuple[int, ...] = (2048, 4096, 8192, 16384),
    fastest_slabs: tuple[str, ...] = ("256MiB", "1GiB", "4GiB"),
) -> list[Method]:
    """The suite's rows: floor, ours (default policy and fixed chunks, bf16 and fp32 accumulation), peers.

    ``policy`` is what the ``ours_default`` rows run (default: ``FLCEPolicy.default()``).
    """
    from flce_policy import FLCEPolicy
    from flce_policy.strategies import Fastest, HeuristicC

    policy = FLCEPolicy.default() if policy is None else policy
    methods = [Method(FLOOR, "floor", step=gemm_floor)]
    for accum, dtype in _ACCUM_DTYPES.items():
        methods.append(
            Method(
                f"ours_default_{accum}",
                "ours default",
                ours(lambda _inputs: policy, dtype),
                accum=accum,
                plan=policy.resolve,
            )
        )
        methods += fixed_chunk_methods(chunk_sizes, accum)
        for c in (1, 16):
            methods.append(
                Method(
                    f"liger_c{c}_{accum}",
                    "liger",
                    liger(c, dtype),
                    accum=accum,
                    options={"c": c},
                    plan=HeuristicC(c).geometry,  # Liger's chunk rule, reproduced by HeuristicC
                )
            )
    # the same rows on the other slab forms (bf16): where the forms cross over, and the engine's choice among them
    for form in ("scaled_exp_rows", "scaled_exp_ws", None):
        methods += fixed_chunk_methods(chunk_sizes, "bf16", form)
    # the logits rows with grad_weight's GEMM on a side stream, against the same rows serial
    methods += overlap_chunk_methods(chunk_sizes)
    # Vocab-tiled, one row chunk: each grad_weight slice written once (fp32-accurate, bf16 memory).
    for vocab_chunk in vocab_chunks:
        methods.append(
            Method(
                f"ours_vtile{vocab_chunk}_bf16",
                "ours vocab-tiled",
                ours(partial(_vocab_tiled_for_inputs, vocab_chunk)),
                options={"vocab_chunk": vocab_chunk},
                plan=partial(_vocab_tiled_plan, vocab_chunk),
            )
        )
    # The cost-model strategy under slab limits (and once under the peak of the bf16 gradients
    # plus a 256 MiB slab, fp32-accurate): the report compares each pick with the sweep above.
    fastest = [(slab, accum, None) for slab in fastest_slabs for accum in ("bf16", "fp32")]
    for slab, accum, max_peak in [*fastest, ("256MiB", "fp32", LEAN_PEAK)]:
        strategy = Fastest(max_slab=slab, accum=accum, max_peak=max_peak)
        peak_label = "" if max_peak is None else f"_peak{max_peak}"
        methods.append(
            Method(
                f"ours_fastest{slab}{peak_label}_{accum}",
                "ours fastest",
                ours(lambda inputs, strategy=strategy: strategy, _ACCUM_DTYPES[accum]),
                accum=accum,
                options={"max_slab": parse_bytes(slab), "max_peak": max_peak and parse_bytes(max_peak)},
                plan=strategy.geometry,
            )
        )
    # Within Liger C=16's memory: the cost model's pick under the peak our memory model predicts for
    # Liger's own chunk (it matches Liger's measured peak to 0.1 MB, results/2026-11-29-h200-large-heads).
    within_liger = Fastest(max_slab="64GiB", max_peak=HeuristicC(16))
    # and on the row-scaled slab where it runs, its partials and scaled x_c in the peak: the largest multiple of
    # 128 rows under Liger's peak (a power of two under it is half Liger's chunk)
    within_liger_rows = Fastest(
        max_slab="64GiB", max_peak=HeuristicC(16), slab_form="scaled_exp_rows", chunk_multiple=128
    )
    for suffix, strategy in (("", within_liger), ("_rows", within_liger_rows)):
        methods.append(
            Method(
                f"ours_within_liger_c16_peak{suffix}_bf16",
                "ours within peak",
                ours(lambda _inputs, strategy=strategy: strategy),
                options={"max_peak": "liger_c16"},
                plan=strategy.geometry,
            )
        )
    # The scaled-exp slab (issue 25) at the default policy's chunks (each rule's strategy wrapped), with bf16 and
    # fp32 grad_weight accumulation (the target's one-hot term goes beside an fp32 one: kernels/target_grad.py)
    # (and _rows: its row-scaled form where the call allows, no CE pass over the slab)
    # (and _ws: that with the warp-specialised Gluon GEMM on Hopper)
    for suffix, rows, ws in (("", False, False), ("_rows", True, False), ("_ws", True, True)):
        scaled_exp = scaled_exp_policy(policy, rows=rows, warp_specialised=ws)
        for accum, dtype in _ACCUM_DTYPES.items():
            methods.append(
                Method(
                    f"ours_scaled_exp{suffix}_{accum}",
                    "ours scaled-exp",
                    ours(lambda _inputs, scaled_exp=scaled_exp: scaled_exp, dtype),
                    accum=accum,
                    plan=scaled_exp.resolve,
                )
            )
    # grad_weight_filter (issue 26): the default policy (on the H200 the scaled-exp slab's row-scaled form, where
    # the flags take a read of the slab), grad_weight skipping the tiles below 2^-12 ... 2^-16
    for exponent in FILTER_EXPONENTS:
        eps = 2.0**-exponent
        methods.append(
            Method(
                f"ours_filter{exponent}_bf16",
                "ours filtered",
                ours(lambda _inputs: policy, grad_weight_filter=eps),
                options={"grad_weight_filter": eps},
                plan=policy.resolve,
            )
        )
    for exponent, rescue in RESCUED_FILTERS:
        options = {"grad_weight_filter": 2.0**-exponent, "grad_weight_filter_rescue": rescue}
        methods.append(
            Method(
                f"ours_filter{exponent:g}_rescue{rescue}_bf16",
                "ours filtered",
                ours(lambda _inputs: policy, **options),
                options=options,
                plan=policy.resolve,
            )
        )
    methods += softcap_methods(policy)
    methods.append(Method("quack", "quack", quack()))
    methods.append(Method("cce", "cce", cce()))
    methods.append(Method("cce_nofilter", "cce", cce(None)))
    methods.append(Method("eager", "eager", eager))
    return methods


def softcap_methods(policy: FLCEPolicy) -> list[Method]:
    """Gemma's final-logit softcap (:data:`SOFTCAP`, bf16): the default policy with the loss's fp32 softcap, with
    ``softcap_rounding="eager"`` (what ``apply_flce`` passes for Gemma: HF's numbers), pinned to the logits slab, and
    Liger C=16 with its softcap. Each of ours is planned in the slab form its calls run."""
    from flce_policy.strategies import HeuristicC

    ours_rows = {
        f"ours_softcap{SOFTCAP:g}_bf16": {"softcap": SOFTCAP},
        f"ours_softcap{SOFTCAP:g}_eager_bf16": {"softcap": SOFTCAP, "softcap_rounding": "eager"},
        f"ours_softcap{SOFTCAP:g}_logits_bf16": {"softcap": SOFTCAP, "slab_form": "logits"},
    }
    return [
        Method(
            name,
            "ours softcap",
            ours(lambda _inputs: policy, **options),
            options=options,
            plan=_softcap_plan(policy, options),
        )
        for name, options in ours_rows.items()
    ] + [
        Method(
            f"liger_c16_softcap{SOFTCAP:g}_bf16",
            "liger softcap",
            liger(16, softcap=SOFTCAP),
            options={"c": 16, "softcap": SOFTCAP},
            plan=HeuristicC(16).geometry,
        )
    ]


def _softcap_plan(policy: FLCEPolicy, options: dict[str, Any]) -> Plan:
    from flce_policy.engine.policy import softcapped_geometry

    rounding = options.get("softcap_rounding", "fp32")

    def plan(problem: Problem, device: DeviceInfo) -> Geometry:
        geometry = policy.resolve(problem, device)
        if "slab_form" in options:  # the row's pin, as the loss takes it before the call's routing
            geometry = geometry.with_slab_form(options["slab_form"])
        return softcapped_geometry(geometry, options["softcap"], rounding)[0]

    return plan


def select_methods(methods: Sequence[Method], patterns: Sequence[str] | None) -> list[Method]:
    """The methods whose name matches any fnmatch ``pattern`` (case-insensitive), in suite order.

    No patterns selects all. The floor row always stays: every ratio is taken against it.
    A pattern that matches nothing is a ValueError listing the names (a typo would otherwise
    silently benchmark less).
    """
    if not patterns:
        return list(methods)
    lowered = [p.lower() for p in patterns]
    unmatched = [p for p, low in zip(patterns, lowered, strict=True) if not any(_matches(m, low) for m in methods)]
    if unmatched:
        names = ", ".join(m.name for m in methods)
        raise ValueError(f"--methods {' '.join(unmatched)} matches no method; the methods are: {names}")
    return [m for m in methods if m.name == FLOOR or any(_matches(m, low) for low in lowered)]


def _matches(method: Method, pattern: str) -> bool:
    return fnmatch.fnmatchcase(method.name.lower(), pattern)


def predicted_peak(
    method: Method, shape: tuple[int, int, int], device: DeviceInfo, *, dtype: str = "bfloat16"
) -> tuple[int | None, int | None]:
    """(chunk_size, predicted peak bytes) of ``method`` at ``shape`` (BT, H, V) on ``device``.

    The prediction is :func:`flce_policy.plan.memory.predict_peak` at the method's geometry, with an
    fp32 grad_weight accumulator for the fp32 rows; for Liger it is our model at Liger's chunk.
    Rows without a plan (floor, CCE, eager) give ``(method.chunk_size, None)``.
    """
    if method.plan is None:
        return method.chunk_size, None
    geometry = method.plan(Problem(*shape, dtype=dtype), device)
    accum_dtype = "float32" if method.accum == "fp32" else None
    return geometry.chunk_size, predict_peak(geometry, accum_dtype=accum_dtype).total_bytes


def planned_vocab_chunk(
    method: Method, shape: tuple[int, int, int], device: DeviceInfo, *, dtype: str = "bfloat16"
) -> int | None:
    """The vocab tile of ``method``'s geometry at ``shape`` (V for row-only; None without a plan)."""
    if method.plan is None:
        return None
    return method.plan(Problem(*shape, dtype=dtype), device).vocab_chunk


def predicted_time(
    method: Method, shape: tuple[int, int, int], device: DeviceInfo, *, dtype: str = "bfloat16"
) -> float | None:
    """The cost model's fwd+bwd milliseconds for ``method``'s geometry (None without a plan).

    For Liger rows it is our model at Liger's chunk: Liger runs the same three GEMMs per chunk.
    """
    if method.plan is None:
        return None
    geometry = method.plan(Problem(*shape, dtype=dtype), device)
    accum_dtype = "float32" if method.accum == "fp32" else None
    return predict_seconds(geometry, rates_for(device), accum_dtype=accum_dtype).seconds * 1e3
