"""Predicted fwd+bwd time of a geometry from GEMM FLOPs and HBM bytes against a device's rates.

Terms (seconds), each traced to measurements on the H200 (results/2026-11-29-h200-kernels-and-calibration/README.md):

- GEMMs: 3 (row-only) or 4 (vocab-tiled: logits twice) x ``2*BT*H*V`` FLOPs at ``matmul_flops``,
  the rate the three-GEMM floor itself reaches on large shapes;
- grad_weight read-modify-write: every row chunk after the first re-reads and re-writes the
  ``[V, H]`` accumulator (a mixed-precision fp32 accumulate runs at ``fp32_rmw_efficiency`` of HBM);
  an fp32 accumulator is cast once at the end;
- grad_input accumulator of vocab tiles: every tile after the first re-reads and re-writes the
  fp32 ``[chunk_size, H]`` accumulator, for every row;
- the CE kernels: two reads and one write of all logits at ``ce_efficiency`` of HBM;
- late vocab tiles (flce_policy.plan.accumulator) computed a third time: their logits GEMM and a
  read and a write of their logits;
- the grad_weight filter (``geometry.grad_weight_filter``): the grad_weight GEMM and its
  read-modify-write shrink to the kept share ``1 - skipped_share`` of the tiles (a caller's guess:
  the share depends on the logits, 0 by default): the kept share of the GEMM at
  ``filtered_gemm_efficiency`` of the dense rate, plus ``filter_fixed_share`` of it paid whatever is
  kept (listing the kept tiles, writing every block of grad_weight), plus one write and read of the
  per-row flags; with a rescue N (``geometry.grad_weight_filter_rescue``), at least 1/N of the skipped share
  is multiplied after all (1/N taken: the share by level depends on the logits); the kept share's
  cost is capped at a dense GEMM's (the kernel hands a chunk with nearly every tile kept to cuBLAS); where it
  is, the fixed share and the flags are paid on the first chunk only (row-only geometry), whose going dense
  ends the call's flagging, and by one call in ``1 + FILTER_REST_CALLS`` (a policy runs that many dense after
  it: the price is their average). These are the TMA launch's (Hopper and later); the
  pointer-based launches that run where TMA cannot are slower, not modelled apart;
- the scaled-exp slab (``geometry.slab_form``): its logits GEMM's main loop at ``scaled_exp_gemm_efficiency`` of
  cuBLAS's rate plus its epilogue, ``scaled_exp_epilogue_flops`` GEMM FLOPs a logit (an exp2 and a sum per element:
  a cost per logit, not per FLOP, so the smaller H the larger its share), and the CE kernels one read and one write
  of the slab (its partials come from the GEMM); ``"scaled_exp_ws"``'s Gluon GEMM at ``ws_gemm_efficiency``, its
  epilogue overlapped;
  in the row-scaled form (``"scaled_exp_rows"``, as calls without a bias or label smoothing run it) no CE
  pass over the slab, x_c scaled per row for grad_weight and grad_input scaled per row (a read and a write
  of each; a grad_weight filter's flags come from the GEMM's row maxima, priced as the flags above);
- vocab parallel (``problem.tp_size > 1``, the problem being one rank's shard): the collectives of
  :func:`flce_policy.plan.collectives.comm_plan`, each paying ``collective_latency_s`` plus a ring
  all-reduce's ``2 (n - 1) / n`` of its bytes at ``link_bytes_per_s``. These two rates are
  ASSUMED (NVLink-class all-reduce bus bandwidth and small-message latency), not yet measured.
Not modelled: ``geometry.overlap_weight_grad`` (grad_weight's GEMM on a second CUDA stream beside grad_input's) is
priced as the serial call (no gain at 256-512 rows on the H100: results/2026-12-05-h100, ``small_slab_schedules``);
so is the Gluon grad_weight GEMM that hides part of the read-modify-write at chunks of up to 640 rows on the H100
(:mod:`flce_policy.plan.weight_grad_gemm`; the loss 8-13% faster at 256-384-row chunks, 0.5-3.7% at 512-640).
At 8192x5376x262144 this predicts 140 / 106 / 102 ms for 256 / 2048 / 8192-row chunks and
137 ms for 8192-column vocab tiles, against 146 / 107 / 104 and 143 ms measured on the H200
(results/2026-11-29-h200-vocab-tiled); tests/test_fastest.py holds every measured row
of that run within 12%.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from flce_policy.plan.accumulator import accumulator_layout
from flce_policy.plan.collectives import comm_plan
from flce_policy.plan.device import DeviceInfo
from flce_policy.plan.geometry import Geometry
from flce_policy.plan.scaled_exp import is_scaled_exp
from flce_policy.plan.weight_filter import ALL_KEPT_COST, FILTER_COLS, FILTER_REST_CALLS

__all__ = [
    "DeviceRates",
    "RATES",
    "rates_for",
    "predict_seconds",
    "collective_seconds",
    "TimeEstimate",
    "rate_coefficients",
    "fit_rates",
    "FormPair",
    "fit_form_terms",
    "form_ratio_error",
]


class DeviceRates(NamedTuple):
    """Achieved rates of a GPU family: dense bf16 GEMM FLOP/s and HBM bytes/s."""

    matmul_flops: float
    hbm_bytes_per_s: float
    ce_efficiency: float = 0.8  # CE kernels reach ~3.4 of 4.3 TB/s on H200
    fp32_rmw_efficiency: float = 0.8  # cuBLAS bf16 x bf16 -> fp32 accumulate, beta=1
    link_bytes_per_s: float = 3.0e11  # all-reduce bus bandwidth between the TP ranks (assumed, NVLink class)
    collective_latency_s: float = 2.5e-5  # one small all-reduce (assumed)
    # The filtered grad_weight kernel against cuBLAS's addmm, per kept tile and fixed. MEASURED on the H200 at one
    # 8192x1024x131072 chunk (results/2026-12-01-h200-filter-kernel-probes/filter-probe-4.log): 1.100x addmm's time
    # with every tile kept, 0.248x with 17.9% kept: time = 0.062 + 1.038 x kept.
    filtered_gemm_efficiency: float = 0.963
    filter_fixed_share: float = 0.062
    # The scaled-exp slab's logits GEMM (a persistent Triton GEMM) against cuBLAS's: its main loop at this share of
    # cuBLAS's rate, then its exp epilogue at this many GEMM FLOPs (of the same SMs) a logit. MEASURED on the H200
    # alone at four small-head chunks (results/2026-12-01-small-heads/h200-persistent-tma.log): the GEMM without the
    # epilogue 1.002-1.098x cuBLAS's time, the epilogue 241-355 FLOPs a logit; not yet in a whole call.
    scaled_exp_gemm_efficiency: float = 0.96
    scaled_exp_epilogue_flops: float = 300.0
    # "scaled_exp_ws"'s warp-specialised Gluon GEMM (the same epilogue, its row sums stored slot-major) against
    # cuBLAS's. MEASURED on the H200 alone at 4096-row chunks of four small heads: 0.958-0.977x cuBLAS's time
    # (results/2026-12-02-h200-gluon-gemm/gluon_rowsum_probe.log, full_t), taken as 1.0.
    ws_gemm_efficiency: float = 1.0
    # What each chunk on the scaled-exp slab costs beyond the logits slab's, in seconds per element of [V, H]
    # (its small chunks lose most where H and V are largest). MEASURED on the H100 with the efficiency above
    # (docs/results.md, "Slab forms"); 0 where unmeasured.
    scaled_exp_chunk_overhead: float = 0.0


#: H200: CALIBRATED by :func:`fit_rates` on the fixed-chunk rows and floors of
#: results/2026-11-29-h200-vocab-tiled (``flce-policy tune`` does the same on any GPU).
#: The rest are DERIVED from the H200 by datasheet ratios (dense bf16 TFLOP/s, HBM TB/s against
#: the H200's 989 and 4.8); override per policy (Fastest ``rates``) or calibrate with ``tune``.
_H200_FLOPS, _H200_BYTES = 7.03e14, 4.57e12


def _derived(dense_tflops: float, hbm_tbs: float) -> DeviceRates:
    return DeviceRates(_H200_FLOPS * dense_tflops / 989, _H200_BYTES * hbm_tbs / 4.8)


# H100: DERIVED rates; the scaled-exp terms FITTED to its sweep of both forms at 256 rows to one chunk, the nine bench
# shapes (results/2026-12-05-h100, ``slab_forms_2026_12_06``): the faster form at 53 of 54, 0.7 ms lost, the two
# forms' time ratio within 1.8% on average (5.8% at worst). ``ws_gemm_efficiency`` FITTED to the loss as those terms
# are: one chunk on the Gluon GEMM 1.4-2.1% faster than on the Triton GEMM at H = 896-1152 (busy start, 2026-12-07),
# which 0.8 predicts at all three. The GEMM alone runs at 0.91 of cuBLAS's rate; the rest of 0.8 is what the form
# costs beyond its GEMM, which the Triton form's fitted epilogue term holds for it.
_H100 = _derived(989, 3.35)._replace(
    scaled_exp_gemm_efficiency=1.0,
    scaled_exp_epilogue_flops=600.0,
    scaled_exp_chunk_overhead=1e-13,
    ws_gemm_efficiency=0.8,
)

RATES: dict[str, DeviceRates] = {
    "H200": DeviceRates(_H200_FLOPS, _H200_BYTES),
    "H100": _H100,
    "H800": _H100,  # the H100's chip and memory (its NVLink capped)
    "GH200": _derived(989, 4.8),
    "H20": _derived(148, 4.0),
    "B200": _derived(2250, 8.0),
    "GB200": _derived(2500, 8.0),
    "B300": _derived(2250, 8.0),
    "GB300": _derived(2500, 8.0),
    "A100": _derived(312, 2.04),
    "A800": _derived(312, 2.04),
    "L40S": _derived(362, 0.864)._replace(link_bytes_per_s=2.0e10),  # PCIe, no NVLink
}


def rates_for(device: DeviceInfo) -> DeviceRates:
    """The family's rates; an unlisted GPU (or the CPU, when planning) gets the H100's."""
    return RATES.get(device.family, RATES["H100"])


class TimeEstimate(NamedTuple):
    seconds: float
    terms: dict[str, float]


def predict_seconds(
    geometry: Geometry, rates: DeviceRates, *, accum_dtype: str | None = None, skipped_share: float = 0.0
) -> TimeEstimate:
    """Predicted fwd+bwd seconds of ``geometry`` (x and W needing grad) at ``rates``.

    ``accum_dtype`` is the loss's grad_weight accumulator ("float32"; None = the geometry's planned
    one); one row chunk writes each slice once and needs none (:meth:`Geometry.accum_itemsize`).
    ``skipped_share``: the share of dL/dlogits tiles the grad_weight filter would skip before any rescue (only
    with ``geometry.grad_weight_filter``; it depends on the logits, so the caller guesses it).
    """
    if not 0.0 <= skipped_share <= 1.0:
        raise ValueError(f"skipped_share must be in [0, 1], got {skipped_share!r}")
    p = geometry.problem
    item = p.itemsize
    hbm = rates.hbm_bytes_per_s
    accum_item = geometry.accum_itemsize(accum_dtype)
    weight_elems = p.vocab * p.hidden
    gemms = 3 if geometry.is_row_only else 4
    recomputed_columns = min(accumulator_layout(geometry).recomputed_tiles * geometry.vocab_chunk, p.vocab)
    rmw_bandwidth = hbm * (rates.fp32_rmw_efficiency if accum_item > item else 1.0)
    one_gemm = 2.0 * p.tokens * p.hidden * p.vocab / rates.matmul_flops
    filtered = geometry.grad_weight_filter is not None
    kept = 1.0 - skipped_share if filtered else 1.0
    if filtered and geometry.grad_weight_filter_rescue is not None:
        # the rescued tiles are multiplied too: at least 1/N of the skipped ones (each at most 2^-L of them by its
        # level L, which the logits decide: the deepest level's share taken, a lower bound)
        kept += skipped_share / geometry.grad_weight_filter_rescue
    scaled_exp = is_scaled_exp(geometry.slab_form)
    rows = geometry.slab_form in ("scaled_exp_rows", "scaled_exp_ws")
    ws = geometry.slab_form == "scaled_exp_ws"
    gemm_efficiency = rates.ws_gemm_efficiency if ws else rates.scaled_exp_gemm_efficiency
    # two reads and a write of the slab; the scaled-exp slab's partials come from the GEMM: a read and a write,
    # and none in its row-scaled form (a filter's flags come from the GEMM's epilogue too)
    ce_passes = 0 if rows else 2 if scaled_exp else 3
    # where so much is kept that the dense GEMM runs, only the first chunk is flagged (its going dense ends the
    # flagging), and only one call in 1 + FILTER_REST_CALLS: the policy's rest runs the others without flags
    dense = kept * ALL_KEPT_COST["tma"] >= 1.0
    flagged_share = (
        (1.0 / geometry.num_chunks if geometry.is_row_only else 1.0) / (1 + FILTER_REST_CALLS) if dense else 1.0
    )
    terms = {
        "gemm": (gemms - 1 if filtered else gemms) * one_gemm,
        # the scaled-exp slab's logits GEMM over cuBLAS's: its main loop, and the Triton GEMM's epilogue per logit
        "scaled_exp_epilogue": one_gemm * (1.0 / gemm_efficiency - 1.0)
        + (0.0 if ws else rates.scaled_exp_epilogue_flops * p.tokens * p.vocab / rates.matmul_flops)
        if scaled_exp
        else 0.0,
        "scaled_exp_chunks": rates.scaled_exp_chunk_overhead * weight_elems * geometry.num_chunks
        if scaled_exp
        else 0.0,
        # the filtered grad_weight GEMM (where the kernel would be slower than cuBLAS, nearly every tile kept, the
        # dense GEMM runs instead), and its flags: one byte per row and 128 classes, written and read
        "grad_weight_filtered": one_gemm * (1.0 if dense else kept / rates.filtered_gemm_efficiency)
        + (one_gemm * rates.filter_fixed_share + 2 * p.tokens * p.vocab / FILTER_COLS / hbm) * flagged_share
        if filtered
        else 0.0,
        "grad_weight_rmw": (1.0 if dense else kept)
        * (geometry.num_chunks - 1)
        * 2
        * weight_elems
        * accum_item
        / rmw_bandwidth,
        "grad_weight_cast": weight_elems * (accum_item + item) / hbm if accum_item > item else 0.0,
        "grad_input_acc": (geometry.num_vocab_chunks - 1) * 2 * p.tokens * p.hidden * 4 / hbm
        if not geometry.is_row_only
        else 0.0,
        "ce": ce_passes * p.tokens * p.vocab * item / (hbm * rates.ce_efficiency),
        "row_scaling": 4 * p.tokens * p.hidden * item / hbm if rows else 0.0,
        "late_tiles": recomputed_columns
        * p.tokens
        * (2.0 * p.hidden / rates.matmul_flops + 2 * item / (hbm * rates.ce_efficiency)),
        "tp_collectives": collective_seconds(geometry, rates),
    }
    return TimeEstimate(sum(terms.values()), terms)


def collective_seconds(geometry: Geometry, rates: DeviceRates) -> float:
    """Seconds one rank spends in the vocab-parallel collectives of ``geometry``'s call (0 without TP)."""
    plan, ranks = comm_plan(geometry), geometry.problem.tp_size
    if not plan.collectives:
        return 0.0
    return plan.collectives * rates.collective_latency_s + 2 * (ranks - 1) / ranks * plan.bytes / rates.link_bytes_per_s


def rate_coefficients(
    geometry: Geometry, *, accum_dtype: str | None = None, base: DeviceRates | None = None
) -> tuple[float, float, float]:
    """``(flop, byte, fixed)``: the model's seconds at ``base``'s other terms (its efficiencies; the defaults when
    None) are ``flop / matmul_flops + byte / hbm_bytes_per_s + fixed``.

    Read off :func:`predict_seconds` itself (each rate set to 1 with the other infinite, and both infinite for the
    seconds no rate scales: the scaled-exp slab's per-chunk term), so a calibration fits exactly the model that
    predicts. The collectives are none of them: left out (no link time, no latency).
    """
    inf = float("inf")
    terms = (base or DeviceRates(1.0, 1.0))._replace(link_bytes_per_s=inf, collective_latency_s=0.0)

    def seconds(matmul_flops: float, hbm_bytes_per_s: float) -> float:
        rates = terms._replace(matmul_flops=matmul_flops, hbm_bytes_per_s=hbm_bytes_per_s)
        return predict_seconds(geometry, rates, accum_dtype=accum_dtype).seconds

    fixed = seconds(inf, inf)
    return seconds(1.0, inf) - fixed, seconds(inf, 1.0) - fixed, fixed


def fit_rates(samples: Iterable[tuple[float, float, float]], base: DeviceRates) -> DeviceRates:
    """``base`` with the GEMM rate and HBM bandwidth that best explain measured times.

    ``samples``: ``(flop, byte, seconds)`` per measurement (:func:`rate_coefficients`, its ``fixed`` seconds taken
    off the measured ones; a pure-GEMM measurement has ``byte = 0``). Least squares on the relative error.
    ValueError when the measurements cannot separate the two rates or a fitted rate is not positive.
    """
    # minimise sum((a*u + b*v) / t - 1)^2 over u = 1/flops, v = 1/bandwidth: 2x2 normal equations
    saa = sab = sbb = sa = sb = 0.0
    count = 0
    for flop, byte, seconds in samples:
        if seconds <= 0:
            raise ValueError(f"a measured time must be positive, got {seconds} s")
        a, b = flop / seconds, byte / seconds
        saa, sab, sbb, sa, sb = saa + a * a, sab + a * b, sbb + b * b, sa + a, sb + b
        count += 1
    det = saa * sbb - sab * sab
    if count < 2 or det <= 1e-12 * saa * sbb:
        raise ValueError(
            f"{count} measurement(s) do not separate the GEMM rate from the memory bandwidth: "
            "measure shapes or chunk sizes whose memory traffic differs"
        )
    u = (sa * sbb - sb * sab) / det
    v = (sb * saa - sa * sab) / det
    if u <= 0 or v <= 0:
        raise ValueError(
            f"the measurements fit a non-positive rate (1/GEMM rate {u:.3g}, 1/bandwidth {v:.3g}): "
            "the model does not describe them; keep the table's rates"
        )
    return base._replace(matmul_flops=1.0 / u, hbm_bytes_per_s=1.0 / v)


class FormPair(NamedTuple):
    """One chunk geometry measured on the logits slab and on a Triton-GEMM scaled-exp form, seconds each."""

    logits: Geometry
    scaled_exp: Geometry
    logits_seconds: float
    scaled_exp_seconds: float


#: The grid :func:`fit_form_terms` searches: the Triton GEMM's main loop against cuBLAS's, its epilogue in GEMM FLOPs
#: a logit, the seconds a chunk costs per ``[V, H]`` element (the H100's fit: 1.0, 600, 1e-13; the H200's kernel log:
#: 0.96, 300).
FORM_TERM_GRID = (
    (0.88, 0.92, 0.96, 1.0),
    tuple(range(0, 1250, 50)),
    (0.0, 2e-14, 5e-14, 1e-13, 2e-13, 5e-13),
)


def fit_form_terms(pairs: Iterable[FormPair], base: DeviceRates) -> tuple[DeviceRates, float]:
    """``base`` with the scaled-exp terms (``scaled_exp_gemm_efficiency``, ``scaled_exp_epilogue_flops``,
    ``scaled_exp_chunk_overhead``) of :data:`FORM_TERM_GRID` that best predict how much faster one slab is than the
    other, and that mean ``|predicted ratio / measured ratio - 1|``. ValueError without a pair."""
    pairs = list(pairs)
    if not pairs:
        raise ValueError("no chunk size was measured on both the logits slab and a scaled-exp slab")
    # the logits slab's predictions hold no scaled-exp term: the same at every point of the grid
    logits_seconds = [predict_seconds(pair.logits, base).seconds for pair in pairs]
    best: tuple[float, DeviceRates] | None = None
    for efficiency in FORM_TERM_GRID[0]:
        for epilogue in FORM_TERM_GRID[1]:
            for overhead in FORM_TERM_GRID[2]:
                rates = base._replace(
                    scaled_exp_gemm_efficiency=efficiency,
                    scaled_exp_epilogue_flops=float(epilogue),
                    scaled_exp_chunk_overhead=overhead,
                )
                error = _ratio_error(pairs, logits_seconds, rates)
                if best is None or error < best[0]:
                    best = (error, rates)
    assert best is not None
    return best[1], best[0]


def form_ratio_error(pairs: Iterable[FormPair], rates: DeviceRates) -> float:
    """The mean ``|predicted / measured - 1|`` of the scaled-exp slab's time over the logits slab's, at ``rates``."""
    pairs = list(pairs)
    return _ratio_error(pairs, [predict_seconds(pair.logits, rates).seconds for pair in pairs], rates)


def _ratio_error(pairs: list[FormPair], logits_seconds: list[float], rates: DeviceRates) -> float:
    errors = [
        abs(
            predict_seconds(pair.scaled_exp, rates).seconds / logits / (pair.scaled_exp_seconds / pair.logits_seconds)
            - 1
        )
        for pair, logits in zip(pairs, logits_seconds, strict=True)
    ]
    return sum(errors) / len(errors)
