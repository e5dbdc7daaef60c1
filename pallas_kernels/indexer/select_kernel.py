"""Pallas kernel: exact Top-K of each score row by radix select and compaction, one program per row.

`lax.top_k` with K = 2048 sorts every row, and a causal prefill's rows are as long as the context. Here one
program owns a row and never sorts it:
  1. if the row's prefix holds at most K scores, all its finite ones are the answer;
  2. else find the K-th largest score's 32-bit order key τ digit by digit (`digit_bits` per pass, most
     significant first): a pass counts, for the 2^digit_bits candidates c = τ | d·2^shift, the scores whose
     key is >= c, and keeps the largest digit that still leaves K scores;
  3. the passes also track how many scores lie above the range still open, so after the last one the
     count strictly above τ is known and need = K − that many ties at τ are taken (the lowest positions,
     as `lax.top_k` breaks ties); a pass that finds a candidate bound c with exactly K scores >= c ends
     the search (those K are the answer, no ties): later passes are skipped, and random scores stop
     after about log4(limit / K) + 1 of the 16 two-bit passes;
  4. one compaction pass writes the chosen (position, score) pairs in ascending position order: a prefix
     sum of the chosen mask within each chunk gives each one its output slot (and a second one ranks the
     ties at τ, only when some are taken).
Each pass reads only the row's first `limit` scores (a causal query sees at most pos + 1 keys; the rest
are -inf by construction). Work per row: (32 / digit_bits + 1) passes over `limit` scores, 2^digit_bits - 1
comparisons per score and pass, and no sort. Slots past the row's count are written -1 / -inf.
Why 2-bit digits, 4096-score chunks and 8 warps by default (`tuning.SELECT_*`): the kernel is bound by these
integer comparisons, and that setting ran them fastest; measurements in docs/performance.md#indexer.

Prefilter (`prefilter=True`, the default on rows of at least PREFILTER_MIN_ROWS_PER_WIDTH x its candidate
width): a first kernel finds, per row, a bound with between k and PREFILTER_WIDTH_PER_K x k scores at or above
it and writes those (score, position) pairs in position order; the kernel above then selects among them
instead of the row (the same answer: every score of the Top-K is at or above the bound, and position order
keeps the tie rule). Why: random scores need one statistics pass, one counting pass and one compaction over
the row instead of the radix passes over all of it; measurements in docs/performance.md#indexer.

Order keys: the float32 bits as int32, negative values with their 31 low bits flipped, compare like the
floats under a signed comparison (-inf lowest of the non-NaN values). The radix digits are those of the
unsigned image (key XOR 0x80000000).

Generic Pallas: Triton lowering on GPU, interpret mode on CPU (tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels._pallas import triton_params
from pallas_kernels.indexer.tuning import (
    PREFILTER_MIN_ROWS_PER_WIDTH,
    PREFILTER_PASSES,
    PREFILTER_WIDTH_PER_K,
    SELECT_CHUNK,
    SELECT_DIGIT_BITS,
    SELECT_STAGES,
    SELECT_WARPS,
)

_SIGN = -(1 << 31)  # int32 0x80000000: maps between the signed key and its unsigned radix image
_LOW31 = (1 << 31) - 1


def order_key(x):
    """float32 -> int32 whose signed order is the floats' order."""
    b = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return jnp.where(b < 0, b ^ _LOW31, b)


def _wrap(v: int) -> int:
    """A 32-bit pattern as a Python int in int32 range (jnp rejects 2^31 and up)."""
    return (v + (1 << 31)) % (1 << 32) - (1 << 31)


_NEG_INF_KEY = -2139095041  # order_key(-inf): 0xFF800000 with its low 31 bits flipped


def search_threshold(keys, n_chunks, *, k, chunk, digit_bits):
    """The K-th largest order key of a row of more than k scores, digit by digit (the module docstring's
    steps 2-3). keys(c) -> ([chunk] int32 order keys, anything) of chunk c < n_chunks (-inf keys past the
    row). Returns (thr, need): the Top-K are the keys > thr and the first `need` keys == thr in position
    order (need = 0 when a pass found a bound with exactly k keys at or above it)."""
    radix = 1 << digit_bits

    def digit_pass(shift, carry):
        # tau: the unsigned image's high digits found so far (int32 bits); above: how many keys lie above
        # the range those digits leave open (so the count strictly above τ needs no pass of its own)
        tau, above, _ = carry
        # digit 0 keeps >= k scores by the invariant: only digits 1 .. radix-1 are counted (the kernel is
        # bound by these comparisons)
        cands = [(tau | _wrap(d << shift)) ^ _SIGN for d in range(1, radix)]  # back to signed keys

        # Per-lane counts, summed across the program once per pass: a block-wide sum per chunk and digit
        # (shuffles, shared memory and a barrier each) cost more than the comparisons it counts.
        def body(c, counts):
            key, _ = keys(c)
            return tuple(n + (key >= cand).astype(jnp.int32) for n, cand in zip(counts, cands, strict=True))

        lanes = jax.lax.fori_loop(0, n_chunks, body, (jnp.zeros((chunk,), jnp.int32),) * (radix - 1))
        counts = [jnp.sum(n) for n in lanes]
        best = sum((n >= k).astype(jnp.int32) for n in counts)  # counts fall with the digit
        # keys at or above digit best + 1 now lie above the open range (unchanged when best is the top digit)
        new_above = sum(jnp.where(best == d - 1, n, 0) for d, n in enumerate(counts, start=1)) + jnp.where(
            best == radix - 1, above, 0
        )
        new_tau = tau | (best << shift)  # int32 shift: wraps into the sign bit like the unsigned digit
        # Exactly k keys at or above the chosen candidate (above -inf): those are the answer, whatever the
        # lower digits. Random scores get there after about log4(limit / k) + 1 passes instead of 32 / digit_bits.
        chosen = sum(jnp.where(best == d, n, 0) for d, n in enumerate(counts, start=1))
        chosen_key = sum(jnp.where(best == d, cand, 0) for d, cand in enumerate(cands, start=1))
        exact = (best > 0) & (chosen == k) & (chosen_key > _NEG_INF_KEY)
        return new_tau, new_above, exact

    # done (an earlier pass found a bound c with exactly k keys >= c; tau then holds c): the later passes are
    # skipped whole — their scans and the block-wide sums of their counts (on resident keys, most of a pass)
    zero = n_chunks * 0  # traced: a constant carry yields no value in the Triton lowering of cond
    carry = (zero, zero, zero > 0)
    for shift in range(32 - digit_bits, -1, -digit_bits):
        carry = jax.lax.cond(carry[2], lambda c: c, functools.partial(digit_pass, shift), carry)
    tau, above, done = carry
    # done: take the keys >= c, i.e. strictly above c - 1 (the XOR with the sign bit commutes with -1
    # modulo 2^32, and c > 0 as an unsigned image since its digit is >= 1), no ties
    thr = jnp.where(done, (tau ^ _SIGN) - 1, tau ^ _SIGN)
    # fewer than k finite scores in a long prefix: τ is -inf, and -inf is never taken
    return thr, jnp.where(done | (thr == _NEG_INF_KEY), 0, k - above)


def _select_row(x_ref, pos_ref, limit, vals_ref, idx_ref, *, k, chunk, digit_bits, resident=False):
    """The row's Top-K among the first `limit` scores of x_ref, written to vals_ref / idx_ref. pos_ref: the
    position of each score (a prefiltered row's candidates), or None (the score's own index).
    resident: the caller guarantees limit <= chunk; the one chunk is loaded once and every digit pass and the
    compaction work on it in registers, where each pass would otherwise re-read it and wait for the load
    (the candidates of a split or prefiltered row: k to 2k scores)."""
    # (resident: one chunk, as a traced value: a select between two constants gets a boolean type in the
    # Triton lowering)
    n_chunks = limit * 0 + 1 if resident else (limit + chunk - 1) // chunk
    lane = jax.lax.broadcasted_iota(jnp.int32, (chunk,), 0)

    def load(c):  # the last chunk may run past `limit`: those scores are -inf by the caller's contract
        pos = c * chunk + lane if pos_ref is None else pos_ref[pl.ds(c * chunk, chunk)]
        return x_ref[pl.ds(c * chunk, chunk)], pos

    if resident:
        x0, pos0 = load(0)
        key0 = order_key(x0)

    def keys(c):
        if resident:
            return key0, pos0
        x, pos = load(c)
        return order_key(x), pos

    def values(c):
        return x0 if resident else x_ref[pl.ds(c * chunk, chunk)]

    # A prefix of at most k scores is taken whole: threshold -inf (strictly above it), no ties. (The second
    # branch computes from its operand: a bare constant yields no value in the Triton lowering of cond.)
    thr, need = jax.lax.cond(
        limit > k,
        lambda n: search_threshold(keys, n_chunks + n * 0, k=k, chunk=chunk, digit_bits=digit_bits),
        lambda n: (n * 0 + _NEG_INF_KEY, n * 0),
        limit,
    )

    def compact(with_ties):
        def body(c, carry):
            base, ties_seen = carry
            key, pos = keys(c)
            chosen = key > thr
            if with_ties:
                tie = (key == thr).astype(jnp.int32)
                tie_rank = ties_seen + jnp.cumsum(tie)  # 1-based rank of each tie in the row so far
                chosen = chosen | ((tie == 1) & (tie_rank <= need))
                ties_seen = ties_seen + jnp.sum(tie)
            chosen_i = chosen.astype(jnp.int32)
            slot = jnp.where(chosen, base + jnp.cumsum(chosen_i) - 1, k)  # k: out of the row, never stored
            pltriton.store(idx_ref.at[slot], pos, mask=chosen)
            pltriton.store(vals_ref.at[slot], values(c), mask=chosen)
            return base + jnp.sum(chosen_i), ties_seen

        return lambda n: jax.lax.fori_loop(0, n, body, (n * 0, n * 0))[0]

    # No ties to take (the usual case: the search stopped at a bound with exactly k keys at or above it, or
    # the prefix is taken whole): the compaction skips the ties' prefix sum, one of its two per chunk.
    count = jax.lax.cond(need > 0, compact(True), compact(False), n_chunks)

    def pad(c, carry):  # slots count .. k-1: nothing (disjoint from the slots written above)
        slot = c * chunk + lane
        empty = (slot >= count) & (slot < k)
        slot = jnp.where(empty, slot, k)
        pltriton.store(idx_ref.at[slot], jnp.full((chunk,), -1, jnp.int32), mask=empty)
        pltriton.store(vals_ref.at[slot], jnp.full((chunk,), -jnp.inf, jnp.float32), mask=empty)
        return carry

    jax.lax.fori_loop(count // chunk, (k + chunk - 1) // chunk, pad, 0)
    return limit * 0  # a value for the branches of a cond (a bare constant yields none in the Triton lowering)


def _kernel(limit_ref, x_ref, vals_ref, idx_ref, *, k, chunk, digit_bits):
    _select_row(x_ref, None, limit_ref[0], vals_ref, idx_ref, k=k, chunk=chunk, digit_bits=digit_bits)


def _kernel_prefiltered(limit_ref, count_ref, x_ref, cand_ref, cand_pos_ref, vals_ref, idx_ref, *, k, chunk,
                        digit_bits):  # fmt: skip
    """A prefiltered row (count >= 0) is selected among its `count` candidates, any other one in full."""
    kw = dict(k=k, chunk=chunk, digit_bits=digit_bits)
    count = count_ref[0]
    jax.lax.cond(
        count >= 0,
        lambda n: select_candidates(cand_ref, cand_pos_ref, n, vals_ref, idx_ref, **kw),
        lambda n: _select_row(x_ref, None, limit_ref[0] + n * 0, vals_ref, idx_ref, **kw),
        count,
    )


def select_candidates(cand_ref, pos_ref, n, vals_ref, idx_ref, *, k, chunk, digit_bits):
    """`_select_row` over n compacted candidates (-inf past n for at least one chunk): in registers when they
    fit one chunk (`resident`), else chunk by chunk."""
    kw = dict(k=k, chunk=chunk, digit_bits=digit_bits)
    return jax.lax.cond(
        n <= chunk,
        lambda m: _select_row(cand_ref, pos_ref, m, vals_ref, idx_ref, resident=True, **kw),
        lambda m: _select_row(cand_ref, pos_ref, m, vals_ref, idx_ref, **kw),
        n,
    )


def _normal_quantile(p):
    """Φ⁻¹(p), roughly (Tukey's lambda approximation, within ~0.01 over (0.001, 0.999)): only where to put
    the first pass's bounds, never what is chosen."""
    return 4.91 * (jnp.exp(0.14 * jnp.log(p)) - jnp.exp(0.14 * jnp.log(1.0 - p)))


def _from_key(key):
    """The inverse of `order_key`."""
    return jax.lax.bitcast_convert_type(jnp.where(key < 0, key ^ _LOW31, key), jnp.float32)


# (tuning.py) Candidates of a prefiltered row: between k and PREFILTER_WIDTH_PER_K x k scores at or above a
# bound, found in at most PREFILTER_PASSES bound searches (random scores: the first) before a heavy-tailed or
# tie-heavy row is left to the full selection.


def finite_stats_init(lanes: int, count_dtype):
    """Per-lane (count, sum, sum of squares, min, max) accumulators of finite scores, empty."""
    zeros = jnp.zeros((lanes,), jnp.float32)
    return jnp.zeros((lanes,), count_dtype), zeros, zeros, zeros + jnp.inf, zeros - jnp.inf


def finite_stats_step(acc, v):
    """`acc` updated with the scores v [lanes]; -inf (masked or past the limit) counts nowhere."""
    n, s1, s2, lo, hi = acc
    ok = v > -jnp.inf
    z = jnp.where(ok, v, 0.0)
    return n + ok.astype(n.dtype), s1 + z, s2 + z * z, jnp.minimum(lo, jnp.where(ok, v, jnp.inf)), jnp.maximum(hi, v)


def _prefilter_kernel(limit_ref, x_ref, cand_ref, cand_pos_ref, count_ref, *, k, width, chunk, passes):
    """Find a bound c with k <= #(scores >= c) <= width and write those scores and their positions, in
    position order, to cand / cand_pos (then -inf / -1 up to `width`); count = how many, or -1 where the
    row is too short to gain (at most `width` finite scores) or no bound was found in `passes` searches.

    One pass takes the row's count, mean, spread, min and max of its finite scores; each search counts the
    scores at or above three bounds: first where a normal distribution of that mean and spread puts the
    1.15k, 1.5k and 1.85k largest, then the linear interpolation of the counts so far at 1.5k, the midpoint
    of the open range in value and the midpoint in float order (which halves heavy tails as a radix digit
    would). The selection then reads at most `width` candidates instead of the row: one pass over the row
    for the statistics, about one search and one compaction, where the radix search over the whole row
    takes ten or more passes (random scores: the k-th score has no short binary prefix)."""
    f32 = jnp.float32
    limit = limit_ref[0]
    n_chunks = (limit + chunk - 1) // chunk
    lane = jax.lax.broadcasted_iota(jnp.int32, (chunk,), 0)

    def load(c):  # past `limit` the caller's contract holds -inf: never counted, never chosen
        return x_ref[pl.ds(c * chunk, chunk)]

    scan = jnp.where(limit > width, n_chunks, 0)  # short rows: nothing to gain, straight to the full selection
    init = finite_stats_init(chunk, jnp.int32)
    n, s1, s2, lo, hi = jax.lax.fori_loop(0, scan, lambda c, acc: finite_stats_step(acc, load(c)), init)
    finite = jnp.sum(n)
    mean = jnp.sum(s1) / jnp.maximum(finite, 1).astype(f32)
    spread = jnp.sqrt(jnp.maximum(jnp.sum(s2) / jnp.maximum(finite, 1).astype(f32) - mean * mean, 0.0))
    lo, hi = jnp.min(lo), jnp.max(hi)
    targets = [1.15 * k, 1.5 * k, 1.85 * k]

    def search(i, carry):
        lo, n_lo, hi, n_hi, bound, found = carry
        mid = lo * 0.5 + hi * 0.5
        if i == 0:
            cands = [mean + spread * _normal_quantile(1.0 - t / n_lo.astype(f32)) for t in targets]
        else:
            mid_key = _from_key((order_key(lo) >> 1) + (order_key(hi) >> 1) + (order_key(lo) & order_key(hi) & 1))
            interp = lo + (hi - lo) * ((n_lo.astype(f32) - targets[1]) / (n_lo - n_hi).astype(f32))
            cands = [interp, mid, mid_key]
        cands = [jnp.clip(jnp.where(c == c, c, mid), lo, hi) for c in cands]  # NaN (an overflowed spread): mid

        def body(c, counts):
            v = load(c)
            return tuple(m + (v >= b).astype(jnp.int32) for m, b in zip(counts, cands, strict=True))

        # a bound found (or none to search for): later searches scan nothing
        lanes = jax.lax.fori_loop(0, jnp.where(found == -1, n_chunks, 0), body, (jnp.zeros((chunk,), jnp.int32),) * 3)
        for c, m in zip(cands, (jnp.sum(x) for x in lanes), strict=True):
            fits = (found == -1) & (m >= k) & (m <= width)
            bound, found = jnp.where(fits, c, bound), jnp.where(fits, m, found)
            wider = (found == -1) & (m > width) & (c > lo)
            lo, n_lo = jnp.where(wider, c, lo), jnp.where(wider, m, n_lo)
            fewer = (found == -1) & (m < k) & (c < hi)
            hi, n_hi = jnp.where(fewer, c, hi), jnp.where(fewer, m, n_hi)
        return lo, n_lo, hi, n_hi, bound, found

    # (hi, 1): the max has at least one score at it; only the interpolation reads n_hi, never a decision.
    # found: -1 searching, -2 nothing to search (at most `width` finite scores), else the bound's count.
    # (found as arithmetic: the Triton lowering gives a select between two constants a boolean type)
    carry = (lo, finite, hi, finite * 0 + 1, lo, (finite > width).astype(jnp.int32) - 2)
    for i in range(passes):  # unrolled: the Triton lowering takes no loop whose inner loops' bounds it carries
        carry = search(i, carry)
    *_, bound, found = carry

    def compact(c, base):
        v = load(c)
        chosen = v >= bound
        chosen_i = chosen.astype(jnp.int32)
        slot = jnp.where(chosen, base + jnp.cumsum(chosen_i) - 1, width)  # width: out of the row, never stored
        pltriton.store(cand_ref.at[slot], v, mask=chosen)
        pltriton.store(cand_pos_ref.at[slot], c * chunk + lane, mask=chosen)
        return base + jnp.sum(chosen_i)

    count = jax.lax.fori_loop(0, jnp.where(found >= 0, n_chunks, 0), compact, jnp.int32(0))

    def pad(c, carry):  # candidates count .. width-1: -inf, as the selection's contract past its limit
        slot = c * chunk + lane
        empty = slot >= count
        slot = jnp.where(empty, slot, width)
        pltriton.store(cand_ref.at[slot], jnp.full((chunk,), -jnp.inf, f32), mask=empty)
        pltriton.store(cand_pos_ref.at[slot], jnp.full((chunk,), -1, jnp.int32), mask=empty)
        return carry

    jax.lax.fori_loop(jnp.where(found >= 0, count // chunk, width // chunk), width // chunk, pad, 0)
    count_ref[0] = jnp.where(found >= 0, count, -1)


# (tuning.py) `prefilter=None` runs the prefilter on rows of at least PREFILTER_MIN_ROWS_PER_WIDTH times its
# candidate width.


@functools.partial(
    jax.jit, static_argnames=("k", "chunk", "digit_bits", "interpret", "num_warps", "num_stages", "prefilter")
)
def top_k_rows_pallas(x, limits, *, k, chunk=SELECT_CHUNK, digit_bits=SELECT_DIGIT_BITS, interpret=False,
                      num_warps=SELECT_WARPS, num_stages=SELECT_STAGES, prefilter=None):  # fmt: skip
    """x [R, S] float32 scores (S a multiple of chunk; -inf = not a candidate), limits [R] int32: only the
    first limits[r] scores of row r are candidates, and the caller guarantees the rest are -inf (the kernel
    reads up to the end of the chunk holding the last one) -> (values [R, k] float32, positions [R, k]
    int32): the row's k
    largest finite scores in ascending position order (ties at the K-th value: the lowest positions), then
    -inf / -1.

    prefilter: first narrow each long row to between k and PREFILTER_WIDTH_PER_K x k candidates at or above
    a bound (`_prefilter_kernel`, a second launch), which the selection then reads instead of the row — the
    same result: the candidates keep position order, so ties still go to the lowest positions. None: when
    S >= PREFILTER_MIN_ROWS_PER_WIDTH x that width."""
    r, s = x.shape
    if s % chunk or chunk & (chunk - 1):
        raise ValueError(f"top_k_rows_pallas: chunk={chunk} must be a power of two dividing the row length {s}")
    if 32 % digit_bits:
        raise ValueError(f"top_k_rows_pallas: digit_bits={digit_bits} must divide 32")
    limits = jnp.clip(limits, 0, s).astype(jnp.int32)[:, None]
    x = x.astype(jnp.float32)
    width = -(-(PREFILTER_WIDTH_PER_K * k) // chunk) * chunk
    if prefilter is None:
        prefilter = s >= PREFILTER_MIN_ROWS_PER_WIDTH * width
    params = triton_params(interpret, num_warps, num_stages)
    row = lambda n: pl.BlockSpec((None, n), lambda i: (i, 0))  # noqa: E731
    outs = dict(
        out_specs=[row(k), row(k)],
        out_shape=[jax.ShapeDtypeStruct((r, k), jnp.float32), jax.ShapeDtypeStruct((r, k), jnp.int32)],
        interpret=interpret,
        name="indexer_select",
        **params,
    )
    kw = dict(k=k, chunk=chunk, digit_bits=digit_bits)
    if not prefilter:
        return pl.pallas_call(functools.partial(_kernel, **kw), grid=(r,), in_specs=[row(1), row(s)], **outs)(limits, x)
    cand, cand_pos, count = prefilter_rows(x, limits, k=k, chunk=chunk, interpret=interpret, **params)
    return pl.pallas_call(
        functools.partial(_kernel_prefiltered, **kw),
        grid=(r,),
        in_specs=[row(1), row(1), row(s), row(width), row(width)],
        **outs,
    )(limits, count, x, cand, cand_pos)


def prefilter_rows(x, limits, *, k, chunk, interpret, **params):
    """x [R, S] float32, limits [R, 1] int32 -> (candidates [R, W] float32, their positions [R, W] int32,
    count [R, 1] int32: how many, -1 for rows left to the full selection), W = PREFILTER_WIDTH_PER_K x k
    rounded up to whole chunks (`_prefilter_kernel`)."""
    r, s = x.shape
    width = -(-(PREFILTER_WIDTH_PER_K * k) // chunk) * chunk
    row = lambda n: pl.BlockSpec((None, n), lambda i: (i, 0))  # noqa: E731
    return pl.pallas_call(
        functools.partial(_prefilter_kernel, k=k, width=width, chunk=chunk, passes=PREFILTER_PASSES),
        grid=(r,),
        in_specs=[row(1), row(s)],
        out_specs=[row(width), row(width), row(1)],
        out_shape=[
            jax.ShapeDtypeStruct((r, width), jnp.float32),
            jax.ShapeDtypeStruct((r, width), jnp.int32),
            jax.ShapeDtypeStruct((r, 1), jnp.int32),
        ],
        interpret=interpret,
        name="indexer_prefilter",
        **params,
    )(limits, x)


def top_k_segmented(x, limits, *, k, segments, chunk=SELECT_CHUNK, interpret=False, **knobs):
    """`top_k_rows_pallas` for a few long rows: each row cut into `segments` pieces whose own Top-K run as
    separate programs (the row's K best are among them), then one more selection over each row's
    segments x k candidates — which come in ascending position order (segments in order, -inf pads between
    them), so the lowest-position tie rule carries over. Same result as one program per row, with
    `segments` times the parallelism on the long pass. S must be a multiple of segments x chunk (chunk
    shrinks to the segment)."""
    r, s = x.shape
    seg = s // max(1, segments)
    piece = min(chunk, seg)
    if segments < 1 or s % segments or seg % piece or piece & (piece - 1):
        raise ValueError(f"top_k_segmented: {s} scores do not split into {segments} segments of whole chunks")
    starts = jnp.arange(segments, dtype=jnp.int32) * seg
    seg_limits = jnp.clip(limits[:, None] - starts[None, :], 0, seg).reshape(-1)
    vals, idx = top_k_rows_pallas(
        x.reshape(r * segments, seg), seg_limits, k=k, chunk=piece, interpret=interpret, **knobs
    )
    pos = jnp.where(idx >= 0, idx + jnp.tile(starts, r)[:, None], -1).reshape(r, segments * k)
    vals = vals.reshape(r, segments * k)
    width = -(-(segments * k) // chunk) * chunk
    cand = jnp.pad(vals, [(0, 0), (0, width - segments * k)], constant_values=-jnp.inf)
    vals, j = top_k_rows_pallas(
        cand, jnp.full((r,), segments * k, jnp.int32), k=k, chunk=min(chunk, width), interpret=interpret, **knobs
    )
    return vals, jnp.where(j >= 0, jnp.take_along_axis(pos, jnp.maximum(j, 0), axis=1), -1)
