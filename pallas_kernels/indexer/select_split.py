"""Pallas kernels: exact Top-K of a few long score rows, each row's passes shared by many programs.

`select_kernel.top_k_rows_pallas` gives each row one program: a decode step at batch 1 has one 128K row, so
one SM works and the others wait (slower than `lax.top_k` there; docs/performance.md#indexer). Here each row
is cut into segments of `seg` scores, one program each, and the three passes over the row run on all of them:
  1. statistics: per segment, the count, sum, sum of squares, min and max of its finite scores;
  2. counting: every program combines the row's statistics into NB candidate bounds (where a normal
     distribution of that mean and spread puts the t·k largest, t from 0.5 to 2.5; values spread between
     the max and the min; the mean; the min) and counts its scores at or above each bound;
  3. compaction: every program picks the same bound — the one with the fewest scores at or above it that
     still leaves k (the min, i.e. every finite score, when fewer than k are finite) — takes its write
     offset from the counts of the segments before it, and writes its scores at or above the bound and
     their positions there, in position order.
Then one program per row selects the Top-K among its candidates (`select_kernel._select_row`: radix
select and compaction, ties at the K-th value to the lowest positions), which keeps position order: the
result equals `top_k_rows_pallas` on the whole row for any distribution. The bounds only decide how many
candidates the last step reads: about 1.04-2.1 k on normal, ReLU-weighted (the indexer's), Gumbel,
log-normal and exponential scores; a tie-heavy row may leave more (at worst every finite score), which costs
time, never exactness.

Work per row: three passes over its scores spread over S / seg programs, then one program over the
candidates. Four launches; no sort. Why: the long passes use the whole GPU for a few rows, where one program
per row or `lax.top_k`'s sort do not; measurements in docs/performance.md#indexer.

Best first (`best_first=True`, for the few rows of a decode step): instead of the one program per row, the
row's candidates are ranked against each other — rank(i) = #{j: v_j > v_i} + #{j: v_j = v_i, pos_j < pos_i},
and candidate i is written to slot rank(i) when that is below k — by one program per RANK_BLOCK (16)
candidates, which gives `lax.top_k`'s order with no sort afterwards. Its O(n²) compares (n ≈ 1.04-2.1 k) are
cheap spread over ~n / 16 programs. A row with more than RANK_MAX_PER_K x k (2k) candidates (ties, a heavy
tail) is cut to its k in the same kernel: each program finds the K-th key by the radix search over the
candidates and ranks its 16 of the k chosen against them, so four kernels run per call (three with given
statistics: count, compact, rank) and none of them is a one-program kernel. Why: faster than one program
selecting and XLA sorting the K after; measurements in docs/performance.md#indexer.

Given statistics (`stats=`): the score kernel (`kernel.indexer_scores_pallas(stats=True)`) takes them of its
own scores in registers, so the first pass and its launch go.

Generic Pallas: Triton lowering on GPU, interpret mode on CPU (tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels._pallas import pow2, triton_params
from pallas_kernels.indexer.select_kernel import (
    _NEG_INF_KEY,
    _normal_quantile,
    finite_stats_init,
    finite_stats_step,
    order_key,
    search_threshold,
    select_candidates,
)
from pallas_kernels.indexer.tuning import (
    MIN_SEGMENT,
    PASS_CHUNK,
    PASS_WARPS,
    QUANTILE_TARGETS,
    RANK_BLOCK,
    RANK_GATHER_CHUNK,
    RANK_MAX_PER_K,
    RANK_SEARCH_CHUNK,
    RANK_STAGES,
    RANK_STEP,
    RANK_WARPS,
    SELECT_DIGIT_BITS,
    SELECT_STAGES,
    SELECT_WARPS,
    SPREAD_FRACTIONS,
    TARGET_PROGRAMS,
)

# Bounds counted per row (tuning.py): x k scores at or above where a normal distribution would put them
# (QUANTILE_TARGETS), values at SPREAD_FRACTIONS of the way from the max down to the min (heavy tails), then
# the mean and the min (every finite score: the bound that always leaves k when k are there).
NUM_BOUNDS = len(QUANTILE_TARGETS) + len(SPREAD_FRACTIONS) + 2  # 16: a power of two for the block shapes
_MIN_BOUND = NUM_BOUNDS - 1
STATS = 8  # count, sum, sum of squares, min, max, then zeros (a power-of-two block)
# (tuning.py) The passes aim for TARGET_PROGRAMS programs across all rows, with segments of at least
# MIN_SEGMENT scores (wider rows of a batch reach `chunk` first), PASS_CHUNK scores per step, PASS_WARPS warps
# per program.
# best_first (tuning.py): candidates ranked by comparison up to RANK_MAX_PER_K x k of them (every candidate
# against every other: O(n^2) compares, spread over n / RANK_BLOCK programs, RANK_STEP at a time); a row with
# more has its k chosen by a radix search in every ranking program, RANK_SEARCH_CHUNK candidates per step of
# that search (its loop waits on each step's loads: a long step keeps more of them in flight) and
# RANK_GATHER_CHUNK per step of the scan for a program's chosen ones (a [RANK_BLOCK, step] match in the steps
# that hold them); RANK_WARPS and RANK_STAGES for the ranking kernel.


def segment_size(rows: int, s: int, chunk: int) -> int:
    """Scores per program of the passes: the largest power of two up to rows x S / TARGET_PROGRAMS, kept
    within [MIN_SEGMENT, chunk] (chunk, a power of two dividing S, also bounds it for short rows)."""
    seg = min(MIN_SEGMENT, chunk)
    while seg * 2 <= min(chunk, rows * s // TARGET_PROGRAMS):
        seg *= 2
    return seg


def _stats_kernel(limit_ref, x_ref, stats_ref, *, seg, chunk):
    """stats_ref [STATS]: count, sum, sum of squares, min, max of the finite scores of this segment."""
    n = jnp.clip(limit_ref[0] - pl.program_id(1) * seg, 0, seg)

    # past `limit` the scores are -inf (the caller's contract): never counted
    acc = jax.lax.fori_loop(
        0, (n + chunk - 1) // chunk, lambda c, acc: finite_stats_step(acc, x_ref[pl.ds(c * chunk, chunk)]),
        finite_stats_init(chunk, jnp.float32),
    )  # fmt: skip
    stats_ref[...] = stats_row(acc)


def stats_row(acc):
    """The [STATS] row of per-lane `finite_stats_step` accumulators: count, sum, sum of squares, min, max."""
    vals = (jnp.sum(acc[0]), jnp.sum(acc[1]), jnp.sum(acc[2]), jnp.min(acc[3]), jnp.max(acc[4]))
    lane = jax.lax.broadcasted_iota(jnp.int32, (STATS,), 0)
    out = jnp.zeros((STATS,), jnp.float32)
    for i, v in enumerate(vals):
        out = jnp.where(lane == i, v, out)
    return out


def _bounds(stats, segments, k):
    """stats [P_pad, STATS] of a row's segments (rows >= segments unwritten) -> bounds [NUM_BOUNDS] float32,
    all finite scores' range (+inf everywhere when the row has none: nothing is then at or above them)."""
    f32 = jnp.float32
    valid = jax.lax.broadcasted_iota(jnp.int32, stats.shape, 0) < segments
    # per column first: a whole-tile reduction of an iota-derived mask does not lower under an explicit mesh
    sums = jnp.sum(jnp.where(valid, stats, 0.0), axis=0)  # [STATS]
    mins = jnp.min(jnp.where(valid, stats, jnp.inf), axis=0)
    maxs = jnp.max(jnp.where(valid, stats, -jnp.inf), axis=0)
    col = jax.lax.broadcasted_iota(jnp.int32, (STATS,), 0)
    finite, s1, s2 = (jnp.sum(jnp.where(col == c, sums, 0.0)) for c in range(3))
    lo = jnp.min(jnp.where(col == 3, mins, jnp.inf))
    hi = jnp.max(jnp.where(col == 4, maxs, -jnp.inf))
    n = jnp.maximum(finite, 1.0)
    mean = s1 / n
    spread = jnp.sqrt(jnp.maximum(s2 / n - mean * mean, 0.0))
    cands = [mean + spread * _normal_quantile(1.0 - t * k / n) for t in QUANTILE_TARGETS]
    cands += [hi - (hi - lo) * f for f in SPREAD_FRACTIONS] + [mean, lo]
    lane = jax.lax.broadcasted_iota(jnp.int32, (NUM_BOUNDS,), 0)
    out = jnp.zeros((NUM_BOUNDS,), f32)
    for i, c in enumerate(cands):
        # NaN (t·k past the finite count, or an overflowed spread) -> the min: every finite score
        c = jnp.clip(jnp.where(c == c, c, lo), lo, hi)
        out = jnp.where(lane == i, c, out)
    return jnp.where(finite > 0, out, jnp.inf)


def _count_kernel(limit_ref, stats_ref, x_ref, counts_ref, bounds_ref, *, k, seg, chunk, segments):
    """counts_ref [NUM_BOUNDS]: this segment's scores at or above each of the row's bounds; bounds_ref: the
    bounds (every program of the row writes the same values, from the same statistics: the first `segments`
    rows of stats_ref)."""
    bounds = _bounds(stats_ref[...], segments, k)
    n = jnp.clip(limit_ref[0] - pl.program_id(1) * seg, 0, seg)

    def body(c, acc):
        v = x_ref[pl.ds(c * chunk, chunk)]
        return acc + jnp.sum((v[:, None] >= bounds[None, :]).astype(jnp.int32), axis=0)

    counts_ref[...] = jax.lax.fori_loop(0, (n + chunk - 1) // chunk, body, jnp.zeros((NUM_BOUNDS,), jnp.int32))
    bounds_ref[...] = bounds


def _compact_kernel(limit_ref, counts_ref, bounds_ref, x_ref, cand_ref, pos_ref, n_ref, *, k, seg, chunk, segments,
                    pad):  # fmt: skip
    """Writes this segment's scores at or above the row's chosen bound, and their positions, at its offset
    in the row's candidates; the last segment also writes `pad` slots of -inf / -1 after them (the
    selection reads whole chunks), and n_ref the row's candidate count."""
    p = pl.program_id(1)
    counts = counts_ref[...]  # [P_pad, NUM_BOUNDS]
    seg_i = jax.lax.broadcasted_iota(jnp.int32, counts.shape, 0)
    counts = jnp.where(seg_i < segments, counts, 0)
    totals = jnp.sum(counts, axis=0)  # [NUM_BOUNDS]: scores at or above each bound in the row
    lane = jax.lax.broadcasted_iota(jnp.int32, (NUM_BOUNDS,), 0)
    big = jnp.int32(1 << 30)
    # the fewest candidates that still hold the Top-K; the min (every finite score) when fewer than k exist
    key = jnp.where(totals >= k, totals, big)
    key = jnp.where(lane == _MIN_BOUND, jnp.minimum(key, big - 1), key)
    j = jnp.min(jnp.where(key == jnp.min(key), lane, NUM_BOUNDS))
    bound = jnp.max(jnp.where(lane == j, bounds_ref[...], -jnp.inf))
    col = jax.lax.broadcasted_iota(jnp.int32, counts.shape, 1)
    per_seg = jnp.sum(jnp.where(col == j, counts, 0), axis=1)  # [P_pad]
    offset = jnp.sum(jnp.where(jax.lax.broadcasted_iota(jnp.int32, per_seg.shape, 0) < p, per_seg, 0))
    n_cand = jnp.sum(per_seg)
    n = jnp.clip(limit_ref[0] - p * seg, 0, seg)
    step = jax.lax.broadcasted_iota(jnp.int32, (chunk,), 0)
    width = cand_ref.shape[0]  # the slot of a lane not stored: past the row (no lane may share a stored slot)

    def body(c, base):
        v = x_ref[pl.ds(c * chunk, chunk)]
        chosen = v >= bound  # -inf past the limit is below every bound
        chosen_i = chosen.astype(jnp.int32)
        slot = jnp.where(chosen, base + jnp.cumsum(chosen_i) - 1, width)
        pltriton.store(cand_ref.at[slot], v, mask=chosen)
        pltriton.store(pos_ref.at[slot], p * seg + c * chunk + step, mask=chosen)
        return base + jnp.sum(chosen_i)

    jax.lax.fori_loop(0, (n + chunk - 1) // chunk, body, offset)
    tail = n_cand + jax.lax.broadcasted_iota(jnp.int32, (pad,), 0)
    last = (tail < width) & (p == segments - 1)
    tail = jnp.where(last, tail, width)
    pltriton.store(cand_ref.at[tail], jnp.full((pad,), -jnp.inf, jnp.float32), mask=last)
    pltriton.store(pos_ref.at[tail], jnp.full((pad,), -1, jnp.int32), mask=last)
    n_ref[0] = n_cand


def _select_kernel(n_ref, cand_ref, pos_ref, vals_ref, idx_ref, *, k, chunk, digit_bits):
    """The row's Top-K among its candidates, in position order."""
    select_candidates(cand_ref, pos_ref, n_ref[0], vals_ref, idx_ref, k=k, chunk=chunk, digit_bits=digit_bits)


def _beats(key, pos, v_ref, q_ref, m, step):
    """[block] counts: for each (key, pos), the first m candidates of v_ref / q_ref that come before it in
    `lax.top_k`'s order (a larger value, or the same value at a lower position)."""
    width = v_ref.shape[0]  # gathered by clipped index: a slice past the end would be clamped in interpret mode

    def body(c, cnt):
        j = c * step + jax.lax.broadcasted_iota(jnp.int32, (step,), 0)
        jj = jnp.minimum(j, width - 1)
        key_j, pos_j = order_key(v_ref[jj]), q_ref[jj]
        beats = (key_j[None, :] > key[:, None]) | ((key_j[None, :] == key[:, None]) & (pos_j[None, :] < pos[:, None]))
        return cnt + jnp.sum((beats & (j < m)[None, :]).astype(jnp.int32), axis=1)

    return jax.lax.fori_loop(0, (m + step - 1) // step, body, jnp.zeros(key.shape, jnp.int32))


def _rank_kernel(n_ref, cand_ref, pos_ref, vals_ref, idx_ref, *, k, cap, block, step, chunk, gather_chunk,
                 digit_bits):  # fmt: skip
    """Best first: candidate i goes to slot rank(i) = #{j: v_j > v_i} + #{j: v_j = v_i, pos_j < pos_i} when
    that is below k (the Top-K, ties to the lower position, in `lax.top_k`'s order).
    n <= cap candidates: program p ranks candidates p·block ... against the n, and writes -inf / -1 to the
    slots of its stripe past them.
    n > cap (ties or a heavy tail left more): every program p < k / block finds the row's K-th key itself
    (`search_threshold` over the n, `chunk` at a time), takes the chosen candidates numbered p·block ... in
    position order (a scan, `gather_chunk` at a time, that stops once it has passed them), and ranks those
    above the K-th key against the n; the ties at it follow the k - need above it in position order. Each program
    repeats the search, where a one-program selection kernel before this one would add its launch to every
    call, even those with no row over cap."""
    p = pl.program_id(1)
    lane = jax.lax.broadcasted_iota(jnp.int32, (block,), 0)
    mine = p * block + lane
    n = n_ref[0]
    width = cand_ref.shape[0]

    def store(v, pos, cnt, ok):
        chosen = ok & (cnt < k)
        slot = jnp.where(chosen, cnt, k)  # k: past the row, never stored (no lane may share a stored slot)
        pltriton.store(vals_ref.at[slot], v, mask=chosen)
        pltriton.store(idx_ref.at[slot], pos, mask=chosen)

    def rank_all(m):
        at = jnp.minimum(mine, width - 1)
        v, pos = cand_ref[at], pos_ref[at]
        store(v, pos, _beats(order_key(v), pos, cand_ref, pos_ref, m, step), mine < m)
        return m * 0

    def rank_chosen(m):
        def load(c, width_c):
            j = c * width_c + jax.lax.broadcasted_iota(jnp.int32, (width_c,), 0)
            v = cand_ref[jnp.minimum(j, width - 1)]
            return jnp.where(j < m, order_key(v), _NEG_INF_KEY), j

        search = functools.partial(load, width_c=chunk)
        thr, need = search_threshold(search, (m + chunk - 1) // chunk, k=k, chunk=chunk, digit_bits=digit_bits)
        first = p * block

        def gather(carry):
            # the chosen candidates numbered first ... first + block - 1 (in position order), as candidate
            # index + 1 (0: not found), and for a tie at the K-th key its number among those ties + 1
            c, seen, ties, at, tie_no = carry
            key, j = load(c, gather_chunk)
            tie = key == thr
            n_tie = jnp.sum(tie.astype(jnp.int32))
            # chosen in this step: the keys above and the ties still within need
            n_chosen = jnp.sum((key > thr).astype(jnp.int32)) + jnp.clip(need - ties, 0, n_tie)

            def match(x):  # only for the step that holds some of this program's numbers: two prefix sums
                at, tie_no = x
                tie_i = tie.astype(jnp.int32)
                tie_rank = ties + jnp.cumsum(tie_i)  # 1-based
                chosen = (key > thr) | (tie & (tie_rank <= need))
                number = seen + jnp.cumsum(chosen.astype(jnp.int32)) - 1
                hit = chosen[None, :] & (number[None, :] == first + lane[:, None])  # [block, gather_chunk]
                at = at + jnp.sum(jnp.where(hit, j[None, :] + 1, 0), axis=1)  # one hit per lane at most
                tie_no = tie_no + jnp.sum(jnp.where(hit & tie[None, :], tie_rank[None, :], 0), axis=1)
                return at, tie_no

            at, tie_no = jax.lax.cond(seen + n_chosen > first, match, lambda x: x, (at, tie_no))
            return c + 1, seen + n_chosen, ties + n_tie, at, tie_no

        n_gather = (m + gather_chunk - 1) // gather_chunk
        zeros = jnp.zeros((block,), jnp.int32)
        _, _, _, at, tie_no = jax.lax.while_loop(
            lambda carry: (carry[0] < n_gather) & (carry[1] < first + block),
            gather,
            (m * 0, m * 0, m * 0, zeros, zeros),
        )
        found = at > 0
        at = jnp.maximum(at - 1, 0)
        v, pos = cand_ref[at], pos_ref[at]
        # a tie at the K-th key comes after the k - need keys above it, in position order among the ties:
        # no comparisons (a constant row is all ties); the others are ranked against the m
        above = found & (tie_no == 0)
        cnt = jax.lax.cond(
            jnp.sum(above.astype(jnp.int32)) > 0,
            lambda x: _beats(order_key(v), pos, cand_ref, pos_ref, x, step),
            lambda x: zeros + x * 0,
            m,
        )
        store(v, pos, jnp.where(above, cnt, k - need + tie_no - 1), found)
        return m * 0

    # (each branch computes from its operand: a bare constant yields no value in the Triton lowering of cond)
    jax.lax.cond(
        n > cap,
        lambda m: jax.lax.cond(p * block < k, rank_chosen, lambda x: x * 0, m),
        lambda m: jax.lax.cond(p * block < m, rank_all, lambda x: x * 0, m),
        n,
    )
    # ranks 0 .. min(n, k) - 1 are all taken, once each (n > cap >= k: all k)
    empty = (mine >= jnp.minimum(n, k)) & (mine < k)
    slot = jnp.where(empty, mine, k)
    pltriton.store(vals_ref.at[slot], jnp.full((block,), -jnp.inf, jnp.float32), mask=empty)
    pltriton.store(idx_ref.at[slot], jnp.full((block,), -1, jnp.int32), mask=empty)


def rank_width(k: int) -> tuple[int, int]:
    """(cap, block) of the best-first ranking for k: rows with up to cap candidates are ranked whole, by
    cap / block programs of block candidates (cap >= k: the programs also cover the k output slots)."""
    block = min(RANK_BLOCK, pow2(k))
    cap = -(-RANK_MAX_PER_K * k // block) * block
    return cap, block


@functools.partial(
    jax.jit,
    static_argnames=(
        "k", "chunk", "seg", "best_first", "stats_parts", "interpret", "num_warps", "select_warps", "pass_chunk",
    ),
)  # fmt: skip
def top_k_split(
    x, limits, *, k, chunk=4096, seg=None, best_first=False, stats=None, stats_parts=None, interpret=False,
    num_warps=PASS_WARPS, select_warps=SELECT_WARPS, pass_chunk=PASS_CHUNK,
):  # fmt: skip
    """x [R, S] float32 scores (S a multiple of `chunk`, a power of two; -inf = not a candidate), limits [R]
    int32 with the same contract as `select_kernel.top_k_rows_pallas` (the scores past limits[r] are -inf)
    -> (values [R, k] float32, positions [R, k] int32): the row's k largest finite scores in ascending
    position order (ties at the K-th value: the lowest positions), then -inf / -1 — the same result as
    `top_k_rows_pallas`. seg: scores per program of the passes (None: `segment_size`).
    best_first: the same pairs best first, ties to the lower position, -inf / -1 pads last (`lax.top_k`'s
    order): the candidates are ranked against each other by many programs (`_rank_kernel`) instead of
    selected by one and sorted afterwards.
    stats [R, P, STATS]: the rows' statistics from whoever wrote the scores (`kernel.indexer_scores_pallas(
    stats=True)`: count, sum, sum of squares, min, max of the finite scores of any partition of the row
    into its first `stats_parts` of P entries, P a power of two), in place of the first pass.
    Tuning (defaults in tuning.py): num_warps of the passes, pass_chunk scores per step of a pass (a power of
    two)."""
    r, s = x.shape
    if s % chunk or chunk & (chunk - 1):
        raise ValueError(f"top_k_split: chunk={chunk} must be a power of two dividing the row length {s}")
    seg = segment_size(r, s, chunk) if seg is None else seg
    if s % seg or seg & (seg - 1):
        raise ValueError(f"top_k_split: seg={seg} must be a power of two dividing the row length {s}")
    if pass_chunk <= 0 or pass_chunk & (pass_chunk - 1):
        raise ValueError(f"top_k_split: pass_chunk={pass_chunk} must be a positive power of two")
    segments = s // seg
    p_pad = pow2(segments)
    step = min(pass_chunk, seg)
    limits = limits.astype(jnp.int32).reshape(r, 1)  # each kernel clips it to its segment: no XLA op before them
    x = x.astype(jnp.float32)
    kw = dict(interpret=interpret, **triton_params(interpret, num_warps, 1))
    limit_spec = pl.BlockSpec((None, 1), lambda i, p: (i, 0))
    seg_spec = pl.BlockSpec((None, seg), lambda i, p: (i, p))
    per_seg = lambda n: pl.BlockSpec((None, None, n), lambda i, p: (i, p, 0))  # noqa: E731
    per_row = lambda *n: pl.BlockSpec((None, *n), lambda i, p: (i,) + (0,) * len(n))  # noqa: E731
    grid = (r, segments)
    f32, i32 = jnp.float32, jnp.int32
    if stats is None:
        stats_parts = segments
        stats = pl.pallas_call(
            functools.partial(_stats_kernel, seg=seg, chunk=step),
            grid=grid,
            in_specs=[limit_spec, seg_spec],
            out_specs=per_seg(STATS),
            out_shape=jax.ShapeDtypeStruct((r, p_pad, STATS), f32),
            name="indexer_split_stats",
            **kw,
        )(limits, x)
    elif stats.shape[0] != r or stats.shape[2] != STATS or stats.shape[1] != pow2(stats.shape[1]):
        raise ValueError(f"top_k_split: stats.shape={stats.shape}, expected ({r}, a power of two, {STATS})")
    elif stats_parts is None or not 0 < stats_parts <= stats.shape[1]:
        raise ValueError(f"top_k_split: stats_parts={stats_parts} must be in [1, {stats.shape[1]}] with stats")
    counts, bounds = pl.pallas_call(
        functools.partial(_count_kernel, k=k, seg=seg, chunk=step, segments=stats_parts),
        grid=grid,
        in_specs=[limit_spec, per_row(stats.shape[1], STATS), seg_spec],
        out_specs=[per_seg(NUM_BOUNDS), per_row(NUM_BOUNDS)],
        out_shape=[jax.ShapeDtypeStruct((r, p_pad, NUM_BOUNDS), i32), jax.ShapeDtypeStruct((r, NUM_BOUNDS), f32)],
        name="indexer_split_count",
        **kw,
    )(limits, stats, x)
    cand, cand_pos, n_cand = pl.pallas_call(
        functools.partial(_compact_kernel, k=k, seg=seg, chunk=step, segments=segments, pad=chunk),
        grid=grid,
        in_specs=[limit_spec, per_row(p_pad, NUM_BOUNDS), per_row(NUM_BOUNDS), seg_spec],
        out_specs=[per_row(s), per_row(s), per_row(1)],
        out_shape=[
            jax.ShapeDtypeStruct((r, s), f32),
            jax.ShapeDtypeStruct((r, s), i32),
            jax.ShapeDtypeStruct((r, 1), i32),
        ],  # fmt: skip
        name="indexer_split_compact",
        **kw,
    )(limits, counts, bounds, x)
    cap, block = rank_width(k)
    if best_first:
        # rows of at most cap candidates (all, unless a heavy tail or ties left more) are ranked whole; the
        # others are cut to their k inside the same kernel
        kernel = functools.partial(_rank_kernel, k=k, cap=cap, block=block, step=RANK_STEP, chunk=RANK_SEARCH_CHUNK,
                                   gather_chunk=RANK_GATHER_CHUNK, digit_bits=SELECT_DIGIT_BITS)  # fmt: skip
        grid, spec, name, params = (r, cap // block), per_row, "indexer_split_rank", (RANK_WARPS, RANK_STAGES)
    else:
        kernel = functools.partial(_select_kernel, k=k, chunk=chunk, digit_bits=SELECT_DIGIT_BITS)
        spec = lambda *n: pl.BlockSpec((None, *n), lambda i: (i,) + (0,) * len(n))  # noqa: E731
        grid, name, params = (r,), "indexer_split_select", (select_warps, SELECT_STAGES)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[spec(1), spec(s), spec(s)],
        out_specs=[spec(k), spec(k)],
        out_shape=[jax.ShapeDtypeStruct((r, k), f32), jax.ShapeDtypeStruct((r, k), i32)],
        interpret=interpret,
        name=name,
        **triton_params(interpret, *params),
    )(n_cand, cand, cand_pos)
