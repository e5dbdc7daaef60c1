"""Pallas kernels: chunked KDA prefill in two phases, the intra-chunk work parallel over all chunks and the
inter-chunk recurrence sequential per (sequence, head, tile of V columns).

Chunks of C = 64 tokens. With G the within-chunk running sum of the log decays (G ≤ 0, decreasing), q, k
L2-normalised and q scaled:

Phase 0 (`_cumsum_kernel`): G, the running sum of the log decays within each chunk, float32 and in base 2
(G·log2(e)), so that every exponential below is one exp2.
Phase 1, grid (B, N, chunks), two kernels per chunk:
  `_a_kernel` (`_a_levels`):
    A_qk[a, b] = Σ_k q_ak k_bk exp(G_ak − G_bk)  (a ≥ b),   A_kk[a, b] = β_a Σ_k k_ak k_bk exp(G_ak − G_bk)  (a > b)
  every pair a > b through tensor-core products: the pair is split by exactly one level of a binary
  hierarchy over the chunk, and with P the G row at that level's block middle, exp(G_a − G_b) =
  exp(G_a − P) · exp(P − G_b), both factors ≤ 1 — nothing overflows however strong the gates. Also
  q_g = exp(G) ⊙ q, k_g = exp(G_C − G) ⊙ k, k_b = β exp(G) ⊙ k (so that the solve kernel reads neither G
  nor k: 2 bytes an element instead of 6) and exp(G_C).
  `_solve_kernel`: the UT transform T = (I + A_kk)⁻¹ Diag(β): with D the diagonal 16-row sub-blocks,
  X = (I + D)⁻¹ by the Neumann product (I − D)(I + D²)(I + D⁴)(I + D⁸) and M = X (A_kk − D)
  (block-strictly-lower, M⁴ = 0), (I + A_kk)⁻¹ = (I − M)(I + M²) X; W = (I + A_kk)⁻¹ k_b, U = T v.
Phase 2 (`_state_kernel`, grid (B, N, V/BV); packed sequences (S, N, V/BV)), chunk after chunk with S [K, BV] on chip:
    V' = U − W S;   o = q_g S + A_qk V';   S ← Diag(exp(G_C)) S + k_gᵀ V'
Intermediates between the phases are float32 in HBM (W, U, q_g, k_g, k_b, A_qk); all six in bfloat16 with
precision="bf16" (W, q_g, k_g, k_b, A_qk only enter bf16 products; V' = U − W S is cast to bfloat16 for its
products, so U's rounding is of the same order — fla stores U in bfloat16 too). A_kk stays float32.

Why two phase-1 kernels and the hierarchy over the whole 64-row chunk: phase 1 as one kernel spills
registers, and per-element loops or 16 / 32-row diagonal blocks make more, smaller products; measurements in
docs/performance.md#kda-prefill.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels._pallas import triton_params
from pallas_kernels.linear_attention import state_mosaic
from pallas_kernels.linear_attention.tuning import INTRA_WARPS, STATE_STAGES, WIDE_STATE_STAGES

CHUNK = 64
SUB = 16  # the Neumann chain's diagonal sub-blocks: the smallest tensor-core tile
# Parts of phase 1; leaving some out (zeros / the identity in their place) is a profiling aid only
# (`benchmarks/linear_attention.py --phases` times the phase with each part removed): "levels" are the
# decayed products of A (the a = b terms of A_qk stay), "solve" the inverse.
PARTS = frozenset({"levels", "solve"})
LOG2E = 1.4426950408889634


def state_stages(precision: str) -> int:
    """The state pass's default pipelining stages for products at `precision` (`tuning.py`)."""
    return STATE_STAGES if precision == "bf16" else WIDE_STATE_STAGES


CONTRACT_LAST = (((1,), (1,)), ((), ()))  # a @ bᵀ
CONTRACT_FIRST = (((0,), (0,)), ((), ()))  # aᵀ @ b


def _products(precision: str):
    """Matrix product at a precision: "ieee" (float32), "tf32" (tensor cores, float32 operands rounded to
    TF32) or "bf16" (operands cast to bfloat16, float32 accumulation: what fla's kernels do)."""
    prec = jax.lax.Precision.HIGHEST if precision == "ieee" else jax.lax.Precision.DEFAULT
    cast = (lambda x: x.astype(jnp.bfloat16)) if precision == "bf16" else (lambda x: x)  # noqa: E731

    def dot(a, b, dims=None):
        if dims is None:
            return jnp.dot(cast(a), cast(b), precision=prec, preferred_element_type=jnp.float32)
        return jax.lax.dot_general(cast(a), cast(b), dims, precision=prec, preferred_element_type=jnp.float32)

    return dot


def _source_rows(table, ref, first, n):
    """Rows [first, first + n) of this program's chunk (grid axis 2) of a phase-1 input. Without a table ref is the
    chunk's own block [C, ...]. With table = (first source row, valid rows) refs [chunks] (packed sequences
    read in place, `kda_chunked_pallas(rows=)`) ref is the whole packed input [T_in, ...] of this head: the rows
    are read by index from the chunk's first source row, and rows past its valid ones (the padding after a
    sequence's end) are zeros — a select, so whatever the next sequence holds there, NaN included, is dropped."""
    if table is None:
        return ref[pl.ds(first, n)]
    src_ref, valid_ref = table
    c = pl.program_id(2)
    r = first + jax.lax.broadcasted_iota(jnp.int32, (n,), 0)
    idx = jnp.minimum(src_ref[c] + r, ref.shape[0] - 1)  # a pad row may point past the input's end
    keep = r < valid_ref[c]
    if len(ref.shape) == 1:
        return jnp.where(keep, ref[idx], jnp.zeros((), ref.dtype))
    return jnp.where(keep[:, None], ref[idx, :], jnp.zeros((), ref.dtype))


def _split_table(refs, in_place: bool):
    """A phase-1 kernel's refs -> (the row table or None, the other refs)."""
    return (tuple(refs[:2]), refs[2:]) if in_place else (None, refs)


def _cumsum_kernel(*refs, in_place=False):
    table, (g_ref, o_ref) = _split_table(refs, in_place)
    o_ref[...] = jnp.cumsum(_source_rows(table, g_ref, 0, CHUNK).astype(jnp.float32), axis=0) * LOG2E


def _chunk_cumsum(g, *, interpret, params, rows=None):
    """G·log2(e): the running sum of the log decays within each 64-token chunk in base 2 (the kernels take
    exp2, one instruction, where exp would cost several), float32 [B, T, N, K]; with `rows` (packed inputs
    read in place, `kda_chunked_pallas`) [1, 64·chunks, N, K] in the chunk-aligned layout."""
    b, t, n, dk = g.shape
    spec = pl.BlockSpec((None, CHUNK, None, dk), lambda i, h, c: (i, c, h, 0))
    if rows is not None:
        t = rows[0].shape[0] * CHUNK
    return pl.pallas_call(
        functools.partial(_cumsum_kernel, in_place=rows is not None),
        grid=(b, n, t // CHUNK),
        in_specs=[*_table_specs(rows), _source_spec(g, rows)],
        out_specs=spec,
        out_shape=jax.ShapeDtypeStruct((b, t, n, dk), jnp.float32),
        interpret=interpret,
        name="kda_chunk_cumsum",
        **params,
    )(*(rows or ()), g)


class _RefG:
    """G·log2(e) of one chunk read from its ref [C, K] (the `_chunk_cumsum` output): rows picked by index (a
    register tile has no dynamic rows in Triton's lowering, so the A kernel reads them from the ref)."""

    def __init__(self, ref):
        self.ref = ref

    def whole(self):
        return self.ref[...]

    def rows_at(self, size: int, at: int):
        """[C, K]: every row replaced by row `at` of its block of `size` rows."""
        r = jax.lax.broadcasted_iota(jnp.int32, (self.ref.shape[0],), 0)
        return self.ref[(r // size) * size + at, :]

    def rows(self, first: int, n: int):
        return self.ref[pl.ds(first, n), :]

    def row(self, i: int):
        return self.ref[i, :]


def _inv_norm(x, l2norm: bool):
    """[R, K] float32 -> [R]: each row's L2 normalisation factor (eps 1e-6 under the root), ones without it."""
    if not l2norm:
        return jnp.ones((x.shape[0],), jnp.float32)
    return jax.lax.rsqrt(jnp.sum(x * x, axis=1) + 1e-6)


def _unit_lower_inverse(a_kk, dot_solve, solve, akk_rows):
    """(I + A)⁻¹ of a strictly lower [C, C] float32 A_kk.

    "neumann": with D the diagonal sub-blocks and L the rest, (I + D)⁻¹ = X by the Neumann product
    (I − D)(I + D²)(I + D⁴)(I + D⁸) (D¹⁶ = 0), then I + A = (I + D)(I + X L) and M = X L is block-strictly-lower
    (M⁴ = 0): (I + A)⁻¹ = (I − M)(I + M²) X — ten dependent [C, C] products through `dot_solve`.
    "substitution": row by row in float32, no products: row i of T − I is −A_i − Σ_{j<i} A_ij (T − I)_j, with
    A's row i read through `akk_rows(i)` (a register tile has no dynamic rows: the rows come from memory).
    """
    f32 = jnp.float32
    row = jax.lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1)
    eye = (row == col).astype(f32)
    if solve == "substitution":

        def step(i, t):
            a = -akk_rows(i)  # [C], zero from column i on
            a = a + jnp.sum(a[:, None] * t, axis=0)
            return jnp.where(row == i, a[None, :], t)

        return jax.lax.fori_loop(1, CHUNK, step, jnp.zeros((CHUNK, CHUNK), f32)) + eye
    d = jnp.where(row // SUB == col // SUB, a_kk, 0.0)
    d2 = dot_solve(d, d)
    d4 = dot_solve(d2, d2)
    d8 = dot_solve(d4, d4)
    x = dot_solve(dot_solve(dot_solve(eye - d, eye + d2), eye + d4), eye + d8)
    m = dot_solve(x, a_kk - d)
    return dot_solve(dot_solve(eye - m, eye + dot_solve(m, m)), x)


def _state_kernel(*refs, nc, precision, packed, every=None, count=0, o_packed=False):
    """The state pass over one (row, head, V-block) — with packed sequences (`packed`) over one (sequence, head,
    V-block): seq_start / seq_count [S] int32 name the sequence's chunks, the program walks only those from
    the sequence's initial state and writes its final state (a sequence with no chunk keeps its own).
    o_packed: two more tables (the sequence's first token and tokens in o) and o written in the sequence's
    own rows, each chunk's rows past its end masked off (they are the next sequence's).
    every / count (not with packed): also the state after chunks every, 2·every, ..., count·every, written to
    rows [j·K, (j+1)·K) of the snapshot block (the loop over chunks split into `count` segments of `every`)."""
    if packed:
        start_ref, count_ref, *refs = refs
        tok_ref, len_ref, *refs = refs if o_packed else (None, None, *refs)
        w_ref, u_ref, qg_ref, kg_ref, aqk_ref, gl_ref, s0_ref, o_ref, s_ref = refs
        seq = pl.program_id(0)
        first = start_ref[seq]
    elif every:
        w_ref, u_ref, qg_ref, kg_ref, aqk_ref, gl_ref, s0_ref, o_ref, s_ref, snap_ref = refs
    else:
        w_ref, u_ref, qg_ref, kg_ref, aqk_ref, gl_ref, s0_ref, o_ref, s_ref = refs
    dot = _products(precision)

    def body(c, s):
        rows = pl.ds(c * CHUNK, CHUNK)
        v_new = u_ref[rows, :] - dot(w_ref[rows, :], s)  # [C, BV]
        o = dot(qg_ref[rows, :], s) + dot(aqk_ref[rows, :], v_new)
        if o_packed:  # a masked store: the chunk's rows past the sequence's end belong to the next one
            r = (c - first) * CHUNK + jax.lax.broadcasted_iota(jnp.int32, (CHUNK,), 0)
            out_rows = o_ref.at[pl.ds(tok_ref[seq] + (c - first) * CHUNK, CHUNK), :]
            pltriton.store(out_rows, o.astype(o_ref.dtype), mask=(r < len_ref[seq])[:, None])
        else:
            o_ref[rows, :] = o.astype(o_ref.dtype)
        return gl_ref[c] * s + dot(kg_ref[rows, :], v_new, CONTRACT_FIRST)

    if packed:  # bounds read from memory: still one counted loop (Triton pipelines it like the fixed one)
        s_ref[...] = jax.lax.fori_loop(first, first + count_ref[seq], body, s0_ref[...].astype(jnp.float32))
    elif every:
        dk = s0_ref.shape[0]

        def segment(j, s):
            s = jax.lax.fori_loop(j * every, (j + 1) * every, body, s)
            snap_ref[pl.ds(j * dk, dk), :] = s
            return s

        s = jax.lax.fori_loop(0, count, segment, s0_ref[...].astype(jnp.float32))
        s_ref[...] = jax.lax.fori_loop(count * every, nc, body, s)
    else:
        s_ref[...] = jax.lax.fori_loop(0, nc, body, s0_ref[...].astype(jnp.float32))


def _summary_kernel(w_ref, u_ref, kg_ref, gl_ref, s0_ref, s_ref, *, nc, precision):
    """The state pass without outputs, on the augmented state [M | E] (see `kda_state_summary_pallas`)."""
    dot = _products(precision)

    def body(c, s):
        rows = pl.ds(c * CHUNK, CHUNK)
        v_new = u_ref[rows, :] - dot(w_ref[rows, :], s)
        return gl_ref[c] * s + dot(kg_ref[rows, :], v_new, CONTRACT_FIRST)

    s_ref[...] = jax.lax.fori_loop(0, nc, body, s0_ref[...].astype(jnp.float32))


def _normed_rows(table, q_ref, k_ref, start, n, *, scale, l2norm):
    """Rows [start, start + n) of the chunk (`_source_rows`): L2-normalised q (times scale) and k, float32 [n, K]."""
    q = _source_rows(table, q_ref, start, n).astype(jnp.float32)
    k = _source_rows(table, k_ref, start, n).astype(jnp.float32)
    return q * (_inv_norm(q, l2norm) * scale)[:, None], k * _inv_norm(k, l2norm)[:, None]


def _level_masks(c):
    """(row, column) iotas of a [C, C] tile and, per level h = C/2, C/4, ..., 1: (h, the mask of the pairs that
    level splits); the level's middle row is row h − 1 of each block of 2h rows."""
    ra = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    rb = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    levels, h = [], c // 2
    while h:
        keep = (ra // (2 * h) == rb // (2 * h)) & (ra % (2 * h) >= h) & (rb % (2 * h) < h)
        levels.append((h, keep))
        h //= 2
    return ra, rb, levels


# `a_blocks`: inside a block whose rows share one reference row P (`_block_pairs`), every operand factor
# exp2(±(G − P)) lies in [2^−span, 2^span], span the block's decay in log2 (G_first − G_last, the largest over its
# channels). A block form is taken while span plus log2 of the largest |q|, |k| element (at least 0) stays within
# the products' A_SPAN_LIMIT. Above: operands stay below float32's and bfloat16's 2^128. Below: an element x
# scaled by 2^−span is subnormal where |x| < 2^(span − 126), and a GPU or CPU that flushes subnormals drops it;
# such an x adds at most |q_a||x| to a kept entry, so the limit keeps 2^(limit − 126) under the products' own
# rounding: 2^−10 for bf16 operands (rounding 2^−9), 2^−12 for TF32 (2^−11), 2^−26 for float32 ("ieee", 2^−24;
# docs/performance.md, "KDA prefill"). The kept entries (a ≥ b) are q_a·k_b weighted by exp2(G_a − G_b) <= 1;
# the masked a < b ones may overflow, and a select (not a product) drops them. With bf16 or TF32 products the
# limits admit 16-row blocks at GLM-5.3's safe gate (each g above −5: 15 steps of 7.2 in log2 = 108) with
# L2-normalised q and k.
A_SPAN_LIMIT = {"bf16": 116.0, "tf32": 114.0, "ieee": 100.0}
A_BLOCK_SIZES = (64, 32, 16)  # `a_blocks` values


def check_a_blocks(a_blocks, who: str) -> None:
    """`a_blocks` as the A kernel takes it: sizes from A_BLOCK_SIZES, strictly decreasing; a one-line
    ValueError naming the value otherwise."""
    ok = isinstance(a_blocks, tuple) and all(b in A_BLOCK_SIZES for b in a_blocks)
    if not ok or list(a_blocks) != sorted(set(a_blocks), reverse=True):
        raise ValueError(f"{who}: a_blocks={a_blocks!r} must be a tuple of sizes from {A_BLOCK_SIZES}, largest first")


def _block_pairs(q, k, gr, size, dot):
    """A_qk (a ≥ b) and strict-lower A_kk (without β) over the row pairs inside each block of `size` rows, from
    one reference per block: with P the G row at the block's middle, exp(G_a − G_b) = exp(G_a − P) · exp(P −
    G_b) holds for any P, and each factor is at most 2^span (`_block_span`; bounded by A_SPAN_LIMIT). Two
    [C, K] x [K, C] products (the a = b terms of A_qk included)."""
    c = q.shape[0]
    ra = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    rb = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    g = gr.whole()
    p = gr.rows_at(size, size // 2)  # [C, K]: each row's block reference
    left, right = jnp.exp2(g - p), jnp.exp2(p - g)
    same = ra // size == rb // size
    a_qk = jnp.where(same & (ra >= rb), dot(q * left, k * right, CONTRACT_LAST), 0.0)
    a_kk = jnp.where(same & (ra > rb), dot(k * left, k * right, CONTRACT_LAST), 0.0)
    return a_qk, a_kk


def _block_span(gr, size):
    """The largest decay span of the chunk's blocks of `size` rows, log2 units: max over rows and channels of
    G_first − G_row (G decreases within a block). A NaN in G may pass where the max drops NaNs (the GPU's);
    it makes the block form's entries NaN as it does the levels'."""
    return _max_of_tile(gr.rows_at(size, 0) - gr.whole())


def _max_of_tile(x):
    """The largest element of a 2-D tile, one axis at a time: Pallas's Triton lowering of a reduction over
    both axes fails for operands that carry a two-axis sharding (under an explicit mesh)."""
    return jnp.max(jnp.max(x, axis=1))


def _a_pairs(q, k, gr, *, precision, levels, blocks=()):
    """`_a_levels`, or with `blocks` (sizes from A_BLOCK_SIZES, largest first) the first size whose blocks'
    decay span, plus log2 of the largest |q|, |k| element, this chunk keeps within A_SPAN_LIMIT[precision]: the pairs
    inside those blocks by `_block_pairs`, the pairs across them by the levels above (`_a_levels(above=)`):
    2 products at 64 rows, 4 at 32, 6 at 16 against 13. A chunk whose gates are too strong for every size
    takes the levels (a runtime branch per chunk: the kernel compiles every form it may take)."""
    if not blocks or not levels:
        return _a_levels(q, k, gr, precision=precision, levels=levels)
    dot = _products(precision)

    def with_blocks(size):
        in_qk, in_kk = _block_pairs(q, k, gr, size, dot)
        across_qk, across_kk = _a_levels(q, k, gr, precision=precision, levels=True, above=size)
        return in_qk + across_qk, in_kk + across_kk

    form = lambda: _a_levels(q, k, gr, precision=precision, levels=True)  # noqa: E731
    # the operands' own magnitude (1 for L2-normalised q and k) takes its share of the limit
    largest = jnp.maximum(_max_of_tile(jnp.abs(q)), _max_of_tile(jnp.abs(k)))
    limit = A_SPAN_LIMIT[precision] - jnp.log2(jnp.maximum(largest, 1.0))
    for size in reversed(blocks):  # built innermost first: the largest size is tried first
        form = functools.partial(
            jax.lax.cond, _block_span(gr, size) <= limit, functools.partial(with_blocks, size), form
        )
    return form()


def _a_levels(q, k, gr, *, precision, levels, above=0):
    """A_qk (a ≥ b) and strict-lower A_kk (without β) of one chunk; q, k [C, K] normalised float32, gr reading
    G·log2(e) (`_RefG`). above > 0 (`_a_pairs`): only the pairs of the levels whose blocks are coarser than
    `above` rows, no a = b terms (the block form forms the rest).

    A pair of rows a > b is split by exactly one level h ∈ {32, 16, ..., 1} of a binary hierarchy over the
    chunk: the level whose block of 2h rows holds both, a in its upper half and b in its lower half. With P
    the G row at that block's middle (the last row of its lower half), exp(G_a − G_b) = exp(G_a − P) ·
    exp(P − G_b), both factors ≤ 1 (G decreases): nothing overflows however strong the gates, and a factor
    that underflows bounds the exact value below it. One tile per level serves both sides, E = exp(−|G −
    P(row)|) (the left factor on upper-half rows, the right one on lower-half rows), and each level is two
    masked [C, K] x [K, C] tensor-core products; the a = b terms of A_qk have no decay (one more product):
    13 products per chunk in all."""
    dot = _products(precision)
    ra, rb, hierarchy = _level_masks(q.shape[0])
    a_kk = jnp.zeros(ra.shape, jnp.float32)
    a_qk = a_kk if above else jnp.where(ra == rb, dot(q, k, CONTRACT_LAST), 0.0)
    if not levels:
        return a_qk, a_kk
    g = gr.whole()  # [C, K]
    for h, keep in hierarchy:
        if 2 * h <= above:  # level h: blocks of 2h rows, not coarser than `above`
            continue
        e = jnp.exp2(-jnp.abs(g - gr.rows_at(2 * h, h - 1)))
        qe, ke = q * e, k * e
        a_qk += jnp.where(keep, dot(qe, ke, CONTRACT_LAST), 0.0)
        a_kk += jnp.where(keep, dot(ke, ke, CONTRACT_LAST), 0.0)
    return a_qk, a_kk


def _a_kernel(*refs, scale, l2norm, precision, parts, blocks=(), in_place=False):
    """A_qk, β-scaled strict-lower A_kk (float32), q_g, k_g, β exp(G) ⊙ k (W's right factor, for the solve
    kernel) and exp(G_C) of one chunk (`_a_levels`; with `blocks`, `_a_pairs`). q, k, β through
    `_source_rows` (in place: the packed inputs); G in the chunk layout."""
    table, refs = _split_table(refs, in_place)
    q_ref, k_ref, g_ref, beta_ref, aqk_ref, akk_ref, qg_ref, kg_ref, kb_ref, gl_ref = refs
    gr = _RefG(g_ref)
    q, k = _normed_rows(table, q_ref, k_ref, 0, CHUNK, scale=scale, l2norm=l2norm)
    a_qk, a_kk = _a_pairs(q, k, gr, precision=precision, levels="levels" in parts, blocks=blocks)
    aqk_ref[...] = a_qk.astype(aqk_ref.dtype)
    akk_ref[...] = a_kk * _source_rows(table, beta_ref, 0, CHUNK).astype(jnp.float32)[:, None]
    # the gated tiles 16 rows at a time: the [C, K] tiles above are dead by now, nothing large stays live
    g_last = gr.row(CHUNK - 1)  # [K]
    gl_ref[...] = jnp.exp2(g_last)[:, None]
    for s in range(0, CHUNK, SUB):
        rows = pl.ds(s, SUB)
        q, k = _normed_rows(table, q_ref, k_ref, s, SUB, scale=scale, l2norm=l2norm)
        gs = gr.rows(s, SUB)
        eg = jnp.exp2(gs)
        beta = _source_rows(table, beta_ref, s, SUB).astype(jnp.float32)
        qg_ref[rows, :] = (eg * q).astype(qg_ref.dtype)
        kg_ref[rows, :] = (jnp.exp2(g_last[None, :] - gs) * k).astype(kg_ref.dtype)
        kb_ref[rows, :] = (beta[:, None] * eg * k).astype(kb_ref.dtype)


def _solve_kernel(*refs, precision, solve, parts, in_place=False):
    """W and U of one chunk; v, β through `_source_rows`, k_b and A_kk in the chunk layout."""
    table, (kb_ref, v_ref, beta_ref, akk_ref, w_ref, u_ref) = _split_table(refs, in_place)
    dot = _products(precision)
    dot_solve = _products("tf32" if precision == "bf16" else precision)  # the inverse's chain stays float32
    f32 = jnp.float32
    t_inv = jnp.eye(CHUNK, dtype=f32)
    if "solve" in parts:  # A_kk is this kernel's input: substitution reads its rows without a barrier
        t_inv = _unit_lower_inverse(akk_ref[...], dot_solve, solve, lambda i: akk_ref[i, :])
    beta = _source_rows(table, beta_ref, 0, CHUNK).astype(f32)[:, None]
    w_ref[...] = dot(t_inv, kb_ref[...].astype(f32)).astype(w_ref.dtype)
    u_ref[...] = dot(t_inv, beta * _source_rows(table, v_ref, 0, CHUNK).astype(f32)).astype(u_ref.dtype)


def _chunk_spec(width):
    return pl.BlockSpec((None, CHUNK, None, width), lambda i, h, c: (i, c, h, 0))


def _source_spec(x, rows):
    """A phase-1 input's block (x [B, T, N, ...]): the chunk's rows, or with `rows` (read in place) the whole
    packed input of the head, rows picked in the kernel (`_source_rows`)."""
    if rows is None:
        if x.ndim == 3:
            return pl.BlockSpec((None, CHUNK, None), lambda i, h, c: (i, c, h))
        return _chunk_spec(x.shape[-1])
    if x.ndim == 3:
        return pl.BlockSpec((None, x.shape[1], None), lambda i, h, c: (0, 0, h))
    return pl.BlockSpec((None, x.shape[1], None, x.shape[-1]), lambda i, h, c: (0, 0, h, 0))


def _table_specs(rows):
    """The row table's blocks: both [chunks] int32 arrays whole in every program."""
    if rows is None:
        return []
    return [pl.BlockSpec((rows[0].shape[0],), lambda i, h, c: (0,))] * 2


def _a_call(
    q, k, g, beta, *, scale, l2norm, precision, interpret, num_warps, parts, blocks=(), rows=None,
):  # fmt: skip
    """`_a_kernel` over every chunk; g is G·log2(e) in the chunk layout (`_chunk_cumsum`) -> (A_qk, β-scaled
    A_kk float32, q_g, k_g, β exp(G) ⊙ k, exp(G_C)); q, k, beta read in place with `rows`."""
    b, t, n, dk = q.shape
    if rows is not None:
        t = rows[0].shape[0] * CHUNK
    nc = t // CHUNK
    inter = jnp.bfloat16 if precision == "bf16" else jnp.float32
    kernel = functools.partial(
        _a_kernel, scale=scale, l2norm=l2norm, precision=precision, parts=parts, blocks=blocks,
        in_place=rows is not None,
    )  # fmt: skip
    return pl.pallas_call(
        kernel,
        grid=(b, n, nc),
        in_specs=[*_table_specs(rows), _source_spec(q, rows), _source_spec(k, rows),
                  _chunk_spec(dk), _source_spec(beta, rows)],  # fmt: skip
        out_specs=[
            _chunk_spec(CHUNK), _chunk_spec(CHUNK), _chunk_spec(dk), _chunk_spec(dk), _chunk_spec(dk),
            pl.BlockSpec((None, None, None, dk, 1), lambda i, h, c: (i, c, h, 0, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, t, n, CHUNK), inter), jax.ShapeDtypeStruct((b, t, n, CHUNK), jnp.float32),
            *[jax.ShapeDtypeStruct((b, t, n, dk), inter)] * 3, jax.ShapeDtypeStruct((b, nc, n, dk, 1), jnp.float32),
        ],
        interpret=interpret,
        name="kda_chunk_a",
        **triton_params(interpret, num_warps, 2),
    )(*(rows or ()), q, k, g, beta)  # fmt: skip


def _solve_call(kb, v, beta, akk, *, precision, interpret, num_warps, parts, solve, rows=None):
    """`_solve_kernel` over every chunk: kb = β exp(G) ⊙ k from the A kernel -> (W, U); v, beta read in place
    with `rows`."""
    b, t, n, dk = kb.shape
    dv = v.shape[-1]
    inter = jnp.bfloat16 if precision == "bf16" else jnp.float32
    return pl.pallas_call(
        functools.partial(_solve_kernel, precision=precision, solve=solve, parts=parts, in_place=rows is not None),
        grid=(b, n, t // CHUNK),
        in_specs=[*_table_specs(rows), _chunk_spec(dk), _source_spec(v, rows), _source_spec(beta, rows),
                  _chunk_spec(CHUNK)],  # fmt: skip
        out_specs=[_chunk_spec(dk), _chunk_spec(dv)],
        out_shape=[jax.ShapeDtypeStruct((b, t, n, dk), inter), jax.ShapeDtypeStruct((b, t, n, dv), inter)],
        interpret=interpret,
        name="kda_chunk_solve",
        **triton_params(interpret, num_warps, 2),
    )(*(rows or ()), kb, v, beta, akk)  # fmt: skip


def _intra(
    q, k, v, g, beta, *, scale, l2norm, precision, interpret, num_warps=INTRA_WARPS, parts=PARTS, solve="neumann",
    a_blocks=(), rows=None,
):  # fmt: skip
    """Phase 1 over every chunk: the cumsum, `_a_kernel`, `_solve_kernel` -> (A_qk, W, U, q_g, k_g, exp(G_C)
    [B, chunks, N, K, 1]). num_warps: the (A kernel, solve kernel) warps (the cumsum takes the first);
    a_blocks: the A kernel's block forms to try (`_a_pairs`); rows: packed inputs read in place
    (`kda_chunked_pallas`), the outputs in the chunk layout."""
    a_warps, solve_warps = num_warps
    g = _chunk_cumsum(g, interpret=interpret, params=triton_params(interpret, a_warps, 2), rows=rows)
    aqk, akk, qg, kg, kb, gl = _a_call(
        q, k, g, beta, scale=scale, l2norm=l2norm, precision=precision, interpret=interpret, num_warps=a_warps,
        parts=parts, blocks=a_blocks, rows=rows,
    )  # fmt: skip
    w, u = _solve_call(
        kb, v, beta, akk, precision=precision, interpret=interpret, num_warps=solve_warps, parts=parts, solve=solve,
        rows=rows,
    )  # fmt: skip
    return aqk, w, u, qg, kg, gl


def _seq_spec(t, width, tile=False):
    if tile:
        return pl.BlockSpec((None, t, None, width), lambda i, h, j: (i, 0, h, j))
    return pl.BlockSpec((None, t, None, width), lambda i, h, j: (i, 0, h, 0))


def _gate_spec(nc, dk):
    return pl.BlockSpec((None, nc, None, dk, 1), lambda i, h, j: (i, 0, h, 0, 0))


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "l2norm",
        "block_v",
        "precision",
        "interpret",
        "num_warps",
        "num_stages",
        "solve",
        "parts",
        "state_every",
        "state_impl",
        "a_blocks",
    ),
)
def kda_chunked_pallas(
    q, k, v, g, beta, s0, *, scale, l2norm, block_v, precision="tf32", interpret=False, num_warps=4,
    num_stages=None, solve="neumann", seq_start=None, seq_count=None, parts=PARTS, state_every=None,
    state_impl="triton", a_blocks=(), rows=None, o_rows=None,
):  # fmt: skip
    """q, k, g [B, T, N, K] (T a multiple of 64, K a power of two >= 16); v [B, T, N, V]; beta [B, T, N];
    s0 [B, N, K, V] float32 -> (o [B, T, N, V] in q.dtype, final state [B, N, K, V] float32).

    rows (first source row, valid rows) int32 [chunks]: packed inputs read in place. B = 1 and the inputs hold
    T_in tokens (any count); the kernels run over T = 64·chunks tokens laid out chunk by chunk, chunk c
    holding input rows [first_c, first_c + valid_c) then valid_c < 64 zero rows (g = 0, beta = 0: the state
    unchanged). Only phase 1 reads the inputs, so only its three kernels read by index
    (`_source_rows`); from then on everything is in the layout, o too unless o_rows says where its rows go.
    This is the packed sequences' path (`api._varlen_packed`): reading in place saves XLA copying all five
    inputs into the layout (docs/performance.md, "KDA prefill", has what that copy cost).
    o_rows (first input row, rows) int32 [S], with rows and packed sequences: o comes back in the inputs' rows
    instead, [1, T_in, N, V], sequence s in rows [first_s, first_s + rows_s) (no unpacking of the layout; the
    Triton pass masks each chunk's store to the sequence's rows, `state_mosaic.kda_state_pass_mosaic(o_rows=)`
    stores whole chunks by TMA and the partial ones through a side buffer).

    state_every (a multiple of 64, not with packed sequences): also the states after every state_every tokens,
    [B, T // state_every, N, K, V] float32 (third): the state pass stores its on-chip state at those chunk
    boundaries, one [K, V] write per snapshot and nothing recomputed.

    Packed sequences: with seq_start / seq_count [S] int32 (each sequence's first chunk and number of chunks),
    B = 1 holds S sequences each starting at a chunk boundary (zero-padded to whole chunks: g = 0, beta = 0
    leave the state as it is); s0 is then [S, N, K, V] and the final states come back per sequence — a
    sequence with no chunk keeps its s0 (the final states alias s0's buffer). The intra-chunk phase runs
    over all chunks at once; the state pass is one program per (sequence, head, V-block), each walking only
    its own sequence's chunks (the sequences' recurrences side by side, not one after another).

    state_impl: "triton" (`_state_kernel`) or "mosaic" (`state_mosaic.kda_state_pass_mosaic`: Hopper, or
    Mosaic GPU's interpreter with `interpret`; bf16 intermediates, K 64 or 128, V a multiple of 64; packed
    sequences as in the Triton pass, one program per (head, V-block, sequence); block_v, num_warps and
    num_stages are the Triton kernel's and do not apply to it).

    a_blocks (sizes from A_BLOCK_SIZES, largest first; empty: off): the A kernel forms the row pairs inside
    blocks of the first size whose decay span the chunk keeps within A_SPAN_LIMIT from one reference row per
    block, the rest by the levels (`_a_pairs`: fewer products for mild gates, the same values up to rounding)."""
    if state_impl not in ("triton", "mosaic"):
        raise ValueError(f"kda_chunked_pallas: state_impl={state_impl!r} must be 'triton' or 'mosaic'")
    check_a_blocks(a_blocks, "kda_chunked_pallas")
    b, t, n, dk = q.shape
    dv = v.shape[-1]
    if rows is not None:
        nc = rows[0].shape[0] if rows[0].ndim == 1 else -1
        if b != 1 or nc < 1 or any(r.shape != (nc,) or r.dtype != jnp.int32 for r in rows):
            shapes = [(r.shape, r.dtype.name) for r in rows]
            raise ValueError(f"kda_chunked_pallas: rows={shapes} must be two int32 [chunks] arrays, batch 1 (got {b})")
        t = nc * CHUNK
    t_in = q.shape[1]
    nc = t // CHUNK
    packed = seq_start is not None
    if o_rows is not None and (rows is None or not packed):
        raise ValueError(
            f"kda_chunked_pallas: o_rows needs rows and packed sequences (got rows {rows is not None}, packed {packed})"
        )
    o_rows = None if o_rows is None else tuple(x.astype(jnp.int32) for x in o_rows)
    if packed:
        n_seq = s0.shape[0]
        if o_rows is not None and (len(o_rows) != 2 or any(x.shape != (n_seq,) for x in o_rows)):
            got = [x.shape for x in o_rows]
            raise ValueError(f"kda_chunked_pallas: o_rows={got} must be two [S] arrays, S = {n_seq} initial states")
        counts = None if seq_count is None else seq_count.shape
        if b != 1 or seq_start.shape != (n_seq,) or counts != (n_seq,):
            raise ValueError(
                f"kda_chunked_pallas: packed sequences need a batch of one and seq_start / seq_count of the "
                f"{n_seq} initial states' length, got batch {b}, seq_start {seq_start.shape}, seq_count {counts}"
            )
        seq_start, seq_count = seq_start.astype(jnp.int32), seq_count.astype(jnp.int32)
    params = triton_params(interpret, num_warps, num_stages or state_stages(precision))
    if state_impl == "mosaic":
        inter = jnp.bfloat16 if precision == "bf16" else jnp.float32
        why = state_mosaic.unsupported(dk, dv, t, inter, q.dtype)
        if why is not None:
            raise ValueError(f"kda_chunked_pallas: the Mosaic GPU state pass needs {why}")
    aqk, w, u, qg, kg, gl = _intra(
        q, k, v, g, beta, scale=scale, l2norm=l2norm, precision=precision, interpret=interpret, solve=solve,
        parts=parts, a_blocks=tuple(a_blocks), rows=rows,
    )  # fmt: skip
    if state_impl == "mosaic":
        out = state_mosaic.kda_state_pass_mosaic(
            w, u, qg, kg, aqk, gl, s0.astype(jnp.float32), state_every=state_every, interpret=interpret,
            seqs=(seq_start, seq_count) if packed else None,
            **({} if o_rows is None else dict(o_rows=o_rows, o_tokens=t_in)),
        )  # fmt: skip
        if state_every is None:
            return out
        o, s, snaps = out
        count = t // state_every
        return o, s, jnp.moveaxis(snaps.reshape(b, n, count, dk, dv), 2, 1)
    state = pl.BlockSpec((None, None, dk, block_v), lambda i, h, j: (i, h, 0, j))
    if packed:
        extra = (seq_start, seq_count) + (o_rows or ())
        maps = [pl.BlockSpec((n_seq,), lambda i, h, j: (0,))] * len(extra)
        seq = lambda width, tile=False: pl.BlockSpec(  # noqa: E731 — every sequence's program sees row 0's slab
            (None, t, None, width), (lambda i, h, j: (0, 0, h, j)) if tile else (lambda i, h, j: (0, 0, h, 0))
        )
        gate = pl.BlockSpec((None, nc, None, dk, 1), lambda i, h, j: (0, 0, h, 0, 0))
    else:
        maps, extra = [], ()
        seq, gate = functools.partial(_seq_spec, t), _gate_spec(nc, dk)
    every, count = 0, 0
    t_out = t if o_rows is None else t_in  # o in the layout, or in the sequences' own rows
    o_spec = pl.BlockSpec((None, t_out, None, block_v), lambda i, h, j: (0, 0, h, j)) if packed else seq(block_v, True)
    out_specs = [o_spec, state]
    out_shape = [jax.ShapeDtypeStruct((b, t_out, n, dv), q.dtype), jax.ShapeDtypeStruct(s0.shape, jnp.float32)]
    if state_every is not None:
        if packed or state_every <= 0 or state_every % CHUNK:
            raise ValueError(
                f"kda_chunked_pallas: state_every={state_every!r} must be a positive multiple of {CHUNK} "
                "(and sequences not packed)"
            )
        every, count = state_every // CHUNK, t // state_every
        # snapshot j of (row, head) in rows [j·K, (j+1)·K): a [K, BV] block per (j, V-block), like o's rows
        out_specs.append(pl.BlockSpec((None, None, count * dk, block_v), lambda i, h, j: (i, h, 0, j)))
        out_shape.append(jax.ShapeDtypeStruct((b, n, count * dk, dv), jnp.float32))
    out = pl.pallas_call(
        functools.partial(
            _state_kernel, nc=nc, precision=precision, packed=packed, every=every, count=count,
            o_packed=o_rows is not None,
        ),  # fmt: skip
        grid=(s0.shape[0], n, dv // block_v),
        in_specs=[*maps, seq(dk), seq(block_v, tile=True), seq(dk), seq(dk), seq(CHUNK), gate, state],
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases={len(extra) + 6: 1} if packed else {},
        interpret=interpret,
        name="kda_chunk_state",
        **params,
    )(*extra, w, u, qg, kg, aqk, gl, s0.astype(jnp.float32))  # fmt: skip
    if state_every is None:
        return out
    o, s, snaps = out
    return o, s, jnp.moveaxis(snaps.reshape(b, n, count, dk, dv), 2, 1)


@functools.partial(
    jax.jit,
    static_argnames=(
        "l2norm", "block_v", "precision", "interpret", "num_warps", "num_stages", "a_blocks",
    ),
)  # fmt: skip
def kda_state_summary_pallas(
    k, v, g, beta, *, l2norm, block_v, precision="tf32", interpret=False, num_warps=4, num_stages=None, a_blocks=(),
):  # fmt: skip
    """The affine map of a sequence shard, S_end = M S_start + E (docs/architecture.md §4), from the same two
    phases.

    The state pass is affine in S: S ← M_c S + k_gᵀ U with M_c S = exp(G_C) ⊙ S − k_gᵀ (W S). Running it on
    the augmented state [M | E] [K, K + V], started from [I | 0], with U replaced by [0 | U], leaves
    [M | E] at the end. k, g [B, T, N, K]; v [B, T, N, V]; beta [B, T, N] (same constraints as
    `kda_chunked_pallas`, K + V a multiple of block_v) -> (M [B, N, K, K], E [B, N, K, V]) float32.
    a_blocks: the A kernel's block forms, as `kda_chunked_pallas`'s."""
    check_a_blocks(a_blocks, "kda_state_summary_pallas")
    b, t, n, dk = k.shape
    dv = v.shape[-1]
    nc = t // CHUNK
    params = triton_params(interpret, num_warps, num_stages or state_stages(precision))
    _, w, u, _, kg, gl = _intra(
        k,
        k,
        v,
        g,
        beta,
        scale=1.0,
        l2norm=l2norm,
        precision=precision,
        interpret=interpret,
        a_blocks=tuple(a_blocks),
    )
    u_aug = jnp.concatenate([jnp.zeros((b, t, n, dk), jnp.float32), u], axis=-1)
    eye = jnp.eye(dk, dk + dv, dtype=jnp.float32)
    s0 = jnp.broadcast_to(eye, (b, n, dk, dk + dv))
    state = pl.BlockSpec((None, None, dk, block_v), lambda i, h, j: (i, h, 0, j))
    s = pl.pallas_call(
        functools.partial(_summary_kernel, nc=nc, precision=precision),
        grid=(b, n, (dk + dv) // block_v),
        in_specs=[_seq_spec(t, dk), _seq_spec(t, block_v, tile=True), _seq_spec(t, dk), _gate_spec(nc, dk), state],
        out_specs=state,
        out_shape=jax.ShapeDtypeStruct(s0.shape, jnp.float32),
        interpret=interpret,
        name="kda_chunk_summary",
        **params,
    )(w, u_aug, kg, gl, s0)
    return s[..., :dk], s[..., dk:]
