"""The filtered grad_weight kernel alone, on both of its launches, against fp64 torch over the kept tiles.

``filtered_weight_grad`` runs its TMA launch where descriptors can load both operands (16-bit, rows
16-byte aligned: the interpreter runs it too) and its two pointer-based launches otherwise. The flags are
set here by hand, so every kind of column block occurs: all row tiles kept, none, some (the last row tile
ragged), and the result is checked over two chunks (the first overwrites, the second adds).
"""

from __future__ import annotations

import pytest
import torch
from test_loss_kernel import DEVICE, NEEDS_KERNEL_DEVICE, rel_err

from flce_policy.kernels.tma import tma_tensors
from flce_policy.kernels.weight_grad_filter import filter_scratch, filtered_weight_grad, flag_tiles, observe_tiles
from flce_policy.plan.weight_filter import FILTER_COLS, FILTER_ROWS, KEPT_FLAG, RESCUE_HASH

pytestmark = NEEDS_KERNEL_DEVICE

ROWS = 150  # row tiles of 32 rows, the last 22 (FILTER_ROWS 32)
#: fp32 accumulation of bf16 products against fp64
TOL = 1e-5


def chunk_inputs(seed: int, hidden: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chunk's G and x in bf16 and its kept-tile mask [row tiles, column blocks]: column block 0 keeps
    every row tile, block 1 none, the others a random half (the last row tile always kept somewhere)."""
    g = torch.Generator().manual_seed(seed)
    grad = torch.randn(ROWS, cols, generator=g).to(torch.bfloat16)
    x = torch.randn(ROWS, hidden, generator=g).to(torch.bfloat16)
    row_tiles, col_blocks = -(-ROWS // FILTER_ROWS), -(-cols // FILTER_COLS)
    mask = torch.rand(row_tiles, col_blocks, generator=g) < 0.5
    mask[:, 0], mask[:, 1], mask[-1, 2] = True, False, True
    return grad.to(DEVICE), x.to(DEVICE), mask


def set_flags(scratch, mask: torch.Tensor, cols: int, levels: torch.Tensor | None = None) -> None:
    """Flags per row and column block from the tile mask, one kept row per kept tile (the kernel keeps a
    tile when any of its rows is flagged); with ``levels`` (per tile), an unkept tile's level on one row and a
    level two deeper on another (the tile's is its rows' smallest), else every flag of an unkept tile 0 (the
    largest level)."""
    flags = torch.zeros(ROWS, mask.shape[1], dtype=torch.uint8)
    for r, c in mask.nonzero().tolist():
        flags[min(r * FILTER_ROWS + 7, ROWS - 1), c] = KEPT_FLAG
    if levels is not None:
        for r, c in (~mask).nonzero().tolist():
            flags[min(r * FILTER_ROWS + 3, ROWS - 1), c] = KEPT_FLAG - int(levels[r, c])
            flags[min(r * FILTER_ROWS + 1, ROWS - 1), c] = KEPT_FLAG - int(levels[r, c]) - 2
    scratch.flags[:ROWS, : mask.shape[1]].copy_(flags.to(DEVICE))


@pytest.mark.parametrize(("rows", "cols"), [(150, 512), (8192, 131072), (100, 509)])
def test_the_memory_model_counts_the_filter_s_buffers(rows, cols):
    """What filter_scratch allocates is what the memory model adds to a filtered geometry's peak."""
    from flce_policy import Geometry, Problem
    from flce_policy.plan.memory import predict_peak
    from flce_policy.plan.weight_filter import filter_scratch_bytes

    allocated = sum(t.numel() * t.element_size() for t in filter_scratch(rows, cols, torch.device("meta")))
    assert allocated == filter_scratch_bytes(rows, cols)
    geometry = Geometry.for_problem(Problem(tokens=2 * rows, hidden=64, vocab=cols, dtype="bfloat16"), rows)
    dense = predict_peak(geometry)
    for eps, extra in ((2.0**-12, allocated), (0.0, 0)):  # eps 0 runs the dense path: no buffers
        assert predict_peak(geometry.with_filter(eps)).total_bytes - dense.total_bytes == extra
    assert (
        predict_peak(geometry.with_filter(2.0**-12), weight_grad=False).total_bytes
        == predict_peak(geometry, weight_grad=False).total_bytes
    )  # nor without a weight (or bias) gradient to filter


def random_levels(mask: torch.Tensor, seed: int) -> torch.Tensor:
    """Levels 1 to 3 per tile (read for the unkept ones)."""
    return torch.randint(1, 4, mask.shape, generator=torch.Generator().manual_seed(seed))


def tile_scale(state: torch.Tensor) -> torch.Tensor:
    """fp64 per tile: 1 kept (state 1), 2^L rescued at level L (state 1 + L), 0 skipped."""
    return torch.where(state > 1, 2.0 ** (state.double() - 1), (state == 1).double())


def expand(mask: torch.Tensor, cols: int) -> torch.Tensor:
    return mask.repeat_interleave(FILTER_ROWS, 0)[:ROWS].repeat_interleave(FILTER_COLS, 1)[:, :cols].double()


@pytest.mark.parametrize(
    ("hidden", "cols", "tma"),
    # 60 x 2 bytes, 500 x 2 bytes: rows not 16-byte aligned; 256 and 192 hidden: the TMA launch's wide blocks and
    # its narrow ones for a hidden size that is not a multiple of 256 (two blocks of 128, the second half masked)
    [(64, 512, True), (256, 384, True), (192, 384, True), (60, 512, False), (64, 500, False)],
    ids=["tma", "tma-wide", "tma-narrow", "pointer-x", "pointer-grad"],
)
@pytest.mark.parametrize("with_weight", [True, False], ids=["weight+bias", "bias"])
def test_two_chunks_against_fp64(hidden, cols, tma, with_weight):
    scratch = filter_scratch(ROWS, cols, torch.device(DEVICE))
    grad_weight = torch.full((cols, hidden), float("nan"), device=DEVICE) if with_weight else None
    grad_bias = torch.zeros(cols, device=DEVICE)
    want_w = torch.zeros(cols, hidden, dtype=torch.float64)
    want_b = torch.zeros(cols, dtype=torch.float64)
    for index, seed in enumerate((0, 1)):
        grad, x, mask = chunk_inputs(seed, hidden, cols)
        assert tma_tensors(grad, x) == tma
        set_flags(scratch, mask, cols)
        # about half the tiles kept: the kernel, not the dense fallback
        assert not filtered_weight_grad(grad_weight, grad, x, scratch, first=index == 0, grad_bias=grad_bias)
        kept = grad.cpu().double() * expand(mask, cols)
        want_w += kept.T @ x.cpu().double()
        want_b += kept.sum(0)
    if with_weight:
        assert not grad_weight.isnan().any(), "a block with no kept tile was left unwritten on the first chunk"
        assert rel_err(grad_weight.cpu().double(), want_w) < TOL
        assert torch.all(grad_weight[FILTER_COLS : 2 * FILTER_COLS] == 0)  # column block 1: nothing kept
    assert rel_err(grad_bias.cpu().double(), want_b) < TOL


@pytest.mark.parametrize(
    ("hidden", "cols", "tma"),
    [(64, 512, True), (192, 384, True), (60, 512, False)],
    ids=["tma", "tma-narrow", "pointer"],
)
@pytest.mark.parametrize("fallback", [True, False], ids=["dense-fallback", "kernel"])
def test_every_tile_kept(hidden, cols, tma, fallback):
    """Nothing to skip: the dense GEMM runs (the kernel would be slower), observed as every tile multiplied; with
    the fallback off, the kernel multiplies every tile. Either way fp64's full product, over two chunks."""
    scratch = filter_scratch(ROWS, cols, torch.device(DEVICE))
    grad_weight = torch.full((cols, hidden), float("nan"), device=DEVICE)
    grad_bias = torch.zeros(cols, device=DEVICE)
    want_w = torch.zeros(cols, hidden, dtype=torch.float64)
    want_b = torch.zeros(cols, dtype=torch.float64)
    with observe_tiles() as counts:
        for index, seed in enumerate((0, 1)):
            grad, x, mask = chunk_inputs(seed, hidden, cols)
            assert tma_tensors(grad, x) == tma
            set_flags(scratch, torch.ones_like(mask), cols)
            ran_dense = filtered_weight_grad(
                grad_weight, grad, x, scratch, first=index == 0, grad_bias=grad_bias, dense_fallback=fallback
            )
            assert ran_dense == fallback
            want_w += grad.cpu().double().T @ x.cpu().double()
            want_b += grad.cpu().double().sum(0)
    assert [int(c.kept) for c in counts] == [c.total for c in counts] == [mask.numel()] * 2
    assert rel_err(grad_weight.cpu().double(), want_w) < TOL
    assert rel_err(grad_bias.cpu().double(), want_b) < TOL


@pytest.mark.parametrize(
    ("unflagged", "rescue", "level", "dense"),
    # T tiles (row tiles x 4 column blocks: 20 at 32-row tiles), the pointer launch (1.10x cuBLAS with every tile
    # kept): dense from T / 1.10 multiplied tiles (18.2 of 20), counting a rescue's
    # expected 2^-L of each unflagged one: at level 1 (the last case) the 2 unflagged count 1/2 each, at the
    # largest level 1/16
    [(1, None, None, True), (2, None, None, False), (2, 2, None, True), (2, 16, None, False), (2, 16, 1, True)],
)
def test_the_dense_fallback_counts_flagged_tiles_and_the_rescue_s_share(unflagged, rescue, level, dense):
    hidden, cols = 60, 512
    scratch = filter_scratch(ROWS, cols, torch.device(DEVICE))
    grad, x, mask = chunk_inputs(0, hidden, cols)
    mask = torch.arange(mask.numel()).view(mask.shape) < mask.numel() - unflagged
    set_flags(scratch, mask, cols, None if level is None else torch.full(mask.shape, level))
    grad_weight = torch.full((cols, hidden), float("nan"), device=DEVICE)
    assert filtered_weight_grad(grad_weight, grad, x, scratch, first=True, rescue=rescue) == dense
    if dense:  # every tile, none scaled
        assert rel_err(grad_weight.cpu().double(), grad.cpu().double().T @ x.cpu().double()) < TOL


@pytest.mark.parametrize(
    # flagged: a count of tiles, or minus the unflagged ones (of 20 tiles at 32-row tiles; dense from 18.2, above)
    ("flagged", "rescue", "dense"),
    [(-1, None, True), (4, None, False), (-2, 2, True), (4, 2, False), (4, 4, False)],
)
def test_tiles_flagged_ahead_decide_and_multiply_as_flagged_in_the_call(flagged, rescue, dense):
    """The driver queues :func:`flag_tiles` before the grad_input GEMM and hands its count over: the same dense
    decision and the same grad_weight bit for bit as flags read inside the call, the rescue's included."""
    hidden, cols = 60, 512
    grad, x, mask = chunk_inputs(0, hidden, cols)
    mask = torch.arange(mask.numel()).view(mask.shape) < (flagged if flagged > 0 else mask.numel() + flagged)
    levels = random_levels(mask, 0)
    results = []
    for ahead in (False, True):
        scratch = filter_scratch(ROWS, cols, torch.device(DEVICE))
        set_flags(scratch, mask, cols, levels)
        early = flag_tiles(scratch, ROWS, cols, rescue=rescue) if ahead else None
        grad_weight = torch.full((cols, hidden), float("nan"), device=DEVICE)
        ran_dense = filtered_weight_grad(grad_weight, grad, x, scratch, first=True, rescue=rescue, flagged=early)
        assert ran_dense == dense
        results.append(grad_weight)
    assert torch.equal(results[0], results[1])
    if not dense:  # the kernel kept the flagged tiles (and with a rescue, the hash's)
        state = rescue_state(mask, x, rescue, levels) if rescue else mask.to(torch.uint8)
        want = (grad.cpu().double() * expand(tile_scale(state), cols)).T @ x.cpu().double()
        assert rel_err(results[1].cpu().double(), want) < TOL


def test_tiles_flagged_for_another_slab_are_refused():
    hidden, cols = 60, 512
    grad, x, mask = chunk_inputs(0, hidden, cols)
    scratch = filter_scratch(ROWS, cols, torch.device(DEVICE))
    set_flags(scratch, mask, cols)
    early = flag_tiles(scratch, ROWS - 64, cols)
    with pytest.raises(ValueError, match=r"tiles flagged for a 86x512 slab with rescue None, not this 150x512 one"):
        filtered_weight_grad(
            None, grad, x, scratch, first=True, grad_bias=torch.zeros(cols, device=DEVICE), flagged=early
        )
    early = flag_tiles(scratch, ROWS, cols)  # without the rescue's levels: its count would be wrong
    with pytest.raises(ValueError, match=r"with rescue None, not this 150x512 one with rescue 4"):
        filtered_weight_grad(
            None, grad, x, scratch, first=True, grad_bias=torch.zeros(cols, device=DEVICE), rescue=4, flagged=early
        )


def test_an_ignored_row_clears_its_flags_in_every_block_of_the_row():
    """The CE finish kernel keeps nothing on an ignored row (its gradient is 0: the largest level), in each of its
    column blocks (V = 9000: three blocks of 4096 columns), whatever the flags held before (here all kept)."""
    from flce_policy.kernels.ce_kernel import ce_rows, ce_workspace

    rows, vocab = 4, 9000
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    target = torch.full((rows,), -100, dtype=torch.int64, device=DEVICE)
    workspace = ce_workspace(rows, vocab, logits.device)
    flags = filter_scratch(rows, vocab, logits.device).flags.fill_(KEPT_FLAG)
    loss = torch.empty(rows, device=DEVICE)
    grad_scale = torch.ones(2, device=DEVICE)
    ce_rows(
        logits, target, loss, workspace, ignore_index=-100, grad_scale=grad_scale, filter_flags=flags, filter_eps=0.5
    )
    assert workspace.block_v < vocab  # several blocks per row
    assert (flags[:, : -(-vocab // FILTER_COLS)] == 1).all()


def test_the_finish_kernel_flags_each_group_s_level_below_eps():
    """Each row's flag per FILTER_COLS classes is KEPT_FLAG where some per-token |p - onehot| reaches eps or the
    target lies, else KEPT_FLAG - ceil(log2(eps / the group's largest)), at least 1: against fp64 softmax (ties
    within 1e-4 of an octave left out: fp32 may round either way), over several blocks of a row."""
    from flce_policy.kernels.ce_kernel import ce_rows, ce_workspace

    rows, vocab, eps = 96, 9000, 2.0**-10
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(rows, vocab, generator=g) * 3 + torch.linspace(2.0, -12.0, vocab)
    target = torch.randint(0, vocab, (rows,), generator=g)
    target[5] = -100
    p = logits.double().softmax(-1)
    deviation = (p - torch.nn.functional.one_hot(target.clamp_min(0), vocab).double()).abs()
    deviation[5] = 0.0
    groups = -(-vocab // FILTER_COLS)
    top = torch.nn.functional.pad(deviation, (0, groups * FILTER_COLS - vocab)).view(rows, groups, -1).amax(-1)
    has_target = torch.zeros(rows, groups, dtype=torch.bool)
    has_target[torch.arange(rows), target.clamp_min(0) // FILTER_COLS] = target >= 0
    gap = torch.log2(eps / top)
    level = gap.ceil().clamp(1, KEPT_FLAG - 1)
    want = torch.where((top >= eps) | has_target, KEPT_FLAG, KEPT_FLAG - level).to(torch.uint8)
    clear = ((gap - gap.round()).abs() > 1e-4) | (gap > KEPT_FLAG) | (top >= eps) | has_target
    workspace = ce_workspace(rows, vocab, torch.device(DEVICE))
    flags = filter_scratch(rows, vocab, torch.device(DEVICE)).flags.fill_(0)
    ce_rows(
        logits.to(DEVICE), target.to(DEVICE), torch.empty(rows, device=DEVICE), workspace, ignore_index=-100,
        grad_scale=torch.ones(2, device=DEVICE), filter_flags=flags, filter_eps=eps,
    )  # fmt: skip
    got = flags[:, :groups].cpu()
    assert clear.float().mean() > 0.99
    assert torch.equal(got[clear], want[clear])
    kept, levels = want == KEPT_FLAG, KEPT_FLAG - want.long()
    # the case is one: kept groups, and unkept ones at levels 1, 2, past 16 (a rescue's largest) and the ignored row's
    assert kept.any() and (levels == 1).any() and (levels == 2).any() and (levels > 16).any()
    assert (got[5] == 1).all()


# --------------------------------------------------------------------------- the rescue: a skipped tile kept one in 2^L


def rescue_state(mask: torch.Tensor, x: torch.Tensor, rescue: int, levels: torch.Tensor | None = None) -> torch.Tensor:
    """[row tiles, column blocks]: 1 kept, 1 + L rescued at level L (the tile's ``levels``, at most log2(rescue);
    without them the largest), 0 skipped, by RESCUE_HASH's rule written out in torch."""
    columns, block_mul, mixer = RESCUE_HASH["columns"], RESCUE_HASH["block_mul"], RESCUE_HASH["mixer"]
    mask64 = RESCUE_HASH["mask"]
    row_tiles, col_blocks = mask.shape
    first = x[:, :columns].float().cpu()
    first = torch.nn.functional.pad(first, (0, columns - first.shape[1], 0, row_tiles * FILTER_ROWS - first.shape[0]))
    bits = first.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    folded = ((bits >> 16) ^ (bits & 0xFFFF)).view(row_tiles, FILTER_ROWS * columns)
    weights = 2 * torch.arange(FILTER_ROWS * columns, dtype=torch.int64) + 1
    h = (folded * weights).sum(1) & mask64
    blocks = torch.arange(col_blocks, dtype=torch.int64)
    z = (h[:, None] ^ ((blocks[None, :] * block_mul) & mask64)) & mask64
    for _ in range(RESCUE_HASH["rounds"]):
        z = ((z ^ (z >> 16)) * mixer) & mask64
    max_level = rescue.bit_length() - 1
    level = torch.full(mask.shape, max_level) if levels is None else levels.clamp_max(max_level)
    picked = ((z ^ (z >> 16)) & ((1 << level) - 1)) == 0
    return torch.where(mask, 1, torch.where(picked, 1 + level, 0)).to(torch.uint8)


@pytest.mark.parametrize(
    ("hidden", "cols", "tma"),
    [(64, 512, True), (192, 384, True), (60, 512, False), (64, 500, False)],
    ids=["tma", "tma-narrow", "pointer-x", "pointer-grad"],
)
def test_rescued_tiles_count_2_to_their_level_times(hidden, cols, tma):
    """With a rescue, the kernel's tile states are the hash rule's at each tile's level (checked byte for byte)
    and grad_weight and grad_bias are fp64's over the kept tiles plus 2^L times the rescued ones, over four
    chunks."""
    rescue = 4  # levels 1 and 2 (3 capped to 2): a half and a quarter rescued, some skipped
    scratch = filter_scratch(ROWS, cols, torch.device(DEVICE))
    grad_weight = torch.full((cols, hidden), float("nan"), device=DEVICE)
    grad_bias = torch.zeros(cols, device=DEVICE)
    want_w = torch.zeros(cols, hidden, dtype=torch.float64)
    want_b = torch.zeros(cols, dtype=torch.float64)
    states = []
    for index, seed in enumerate((0, 1, 2, 3)):
        grad, x, mask = chunk_inputs(seed, hidden, cols)
        assert tma_tensors(grad, x) == tma
        levels = random_levels(mask, seed)
        set_flags(scratch, mask, cols, levels)
        filtered_weight_grad(grad_weight, grad, x, scratch, first=index == 0, grad_bias=grad_bias, rescue=rescue)
        state = rescue_state(mask, x, rescue, levels)
        assert torch.equal(scratch.kept[: mask.shape[1], : mask.shape[0]].cpu(), state.T)
        states.append(state)
        part = grad.cpu().double() * expand(tile_scale(state), cols)
        want_w += part.T @ x.cpu().double()
        want_b += part.sum(0)
    both = torch.cat(states)
    assert (both == 2).any() and (both == 3).any() and (both == 0).any()  # both levels rescued, some skipped
    assert rel_err(grad_weight.cpu().double(), want_w) < TOL
    assert rel_err(grad_bias.cpu().double(), want_b) < TOL


def test_the_rescue_is_unbiased_over_the_data():
    """Over draws of x (G and the flags fixed), the rescued estimate of the skipped tiles' grad_bias averages
    to their part (fp64), within the sampling noise, and about one in 2^L of them is rescued at level L."""
    rescue, rows, cols, draws = 8, 512, 1024, 100
    g = torch.Generator().manual_seed(5)
    grad = torch.rand(rows, cols, generator=g).to(torch.bfloat16).to(DEVICE)
    row_tiles, col_blocks = rows // FILTER_ROWS, cols // FILTER_COLS
    mask = torch.rand(row_tiles, col_blocks, generator=g) < 0.2
    levels = torch.randint(1, 4, mask.shape, generator=g)
    skipped = expand_to(~mask, rows, cols)
    want = (grad.cpu().double() * skipped).sum(0)
    scratch = filter_scratch(rows, cols, torch.device(DEVICE))
    total, shares = torch.zeros(cols, dtype=torch.float64), []
    for _ in range(draws):
        x = torch.randn(rows, 2, generator=g).to(torch.bfloat16).to(DEVICE)
        flags = (KEPT_FLAG - levels).to(torch.uint8).repeat_interleave(FILTER_ROWS, 0)
        flags[::FILTER_ROWS][mask] = KEPT_FLAG
        scratch.flags[:rows, :col_blocks].copy_(flags.to(DEVICE))
        grad_bias = torch.zeros(cols, device=DEVICE)
        filtered_weight_grad(None, grad, x, scratch, first=True, grad_bias=grad_bias, rescue=rescue)
        kept_part = (grad.cpu().double() * expand_to(mask, rows, cols)).sum(0)
        total += grad_bias.cpu().double() - kept_part
        state = scratch.kept[:col_blocks, :row_tiles].cpu()
        shares.append(float((state.T > 1).sum() / (~mask).sum()))
    mean = total / draws
    # per column the estimate is a sum of independent 2^L-scaled Bernoulli(2^-L) terms: its standard error
    # over the draws is sqrt(sum((2^L - 1) * part**2) / draws); 5 of them allowed, in norm
    per_tile = (grad.cpu().double() * skipped).view(row_tiles, FILTER_ROWS, cols).sum(1)
    odds = expand_to(2.0**levels - 1, row_tiles * FILTER_ROWS, cols)[::FILTER_ROWS]
    noise = ((odds * per_tile**2).sum(0) / draws).sqrt()
    assert (mean - want).norm() < 5 * noise.norm()
    assert (mean - want).norm() > 0  # an estimate, not the skipped part itself
    expected_share = float((2.0 ** -levels.double())[~mask].mean())
    assert abs(sum(shares) / draws - expected_share) < 0.02


def expand_to(mask: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return mask.repeat_interleave(FILTER_ROWS, 0)[:rows].repeat_interleave(FILTER_COLS, 1)[:, :cols].double()
