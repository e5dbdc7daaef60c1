"""Pallas kernels: MoE experts for decode-sized calls, one program per (token-expert pair, output tile).

At decode sizes a pair's expert sees one row, so the work is a matrix-vector product whose cost is reading
that expert's weights: each program reads its pair's expert id, walks the contraction dimension in BK-row
slabs of W_e [BK, BN] (contiguous along N), and accumulates Σ_k x_k W_e[k, :] in float32 on the CUDA cores
(no tensor-core tile to fill with one row). Nothing is sorted, padded per expert or gathered in HBM: the
weights are read where they lie, k experts per token (two pairs that share an expert read it twice, the
second time mostly from L2).

    h_p = SiLU(x_p W_gate[e_p]) ⊙ (x_p W_up[e_p])      (`gate_up_gemv`, grid (P, F / BF, S))
    y_p = h_p W_down[e_p]                              (`down_gemv`,    grid (P, D / BD, S))

The contraction is split S ways (split-K): each program sums one D / S (or F / S) slab into a float32
partial and XLA adds the S partials (and applies SiLU ⊙) afterwards — [P, S, N] floats, negligible beside
the weights — so that a one-token call still launches enough programs to keep every SM streaming.

A SwiGLU limit L (static, baked into the kernels) clamps the float32 sums where SiLU(gate) ⊙ up is formed
(gate ← min(gate, L), up ← clip(up, −L, L); `reference.clamp_gate_up`): in `gate_up_gemv`'s epilogue, or in
`down_gemv`'s kernels when they form h from the partial sums (routed pairs and shared rows alike).

Generic Pallas: Triton lowering on GPU, interpret mode on CPU (tests). The contraction length must be a
multiple of S x BK and the output width of BN (powers of two); `moe_experts(impl="pallas", form="gemv")` pads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._pallas import first_row, sum_rows, triton_params
from pallas_kernels.moe.reference import check_swiglu_limit, clamp_gate_up
from pallas_kernels.moe.tuning import MAX_SPLIT_K, SPLIT_TARGET  # programs `auto_split_k` aims for; its largest split

MMA_ROWS = 16  # rows of one tensor-core tile: the pair's row broadcast to it


def _mma_step(xk, w):
    """Σ_k x_k w[k, :] as one tensor-core product: the row xk [BK] broadcast to 16 rows; [16, BN] float32."""
    rows = jnp.broadcast_to(xk[None, :], (MMA_ROWS, xk.shape[0]))
    return jnp.dot(rows, w, preferred_element_type=jnp.float32)


def _routed_or_shared(e_ref, routed, shared, n_routed, run):
    """run(weights) with the pair's expert's slabs, or (programs from n_routed on) the shared expert's."""
    e = e_ref[0]
    expert = [lambda cols, ref=ref: ref[e, cols, :] for ref in routed]
    if not shared:
        return run(expert)
    i = pl.program_id(0)
    pl.when(i < n_routed)(lambda: run(expert))
    pl.when(i >= n_routed)(lambda: run([lambda cols, ref=ref: ref[cols, :] for ref in shared]))


def _gate_up_mma_kernel(e_ref, x_ref, wg_ref, wu_ref, *refs, bk, nk, n_routed):
    *shared, g_ref, u_ref = refs

    def run(w):
        def body(kk, acc):
            cols = pl.ds(kk * bk, bk)
            xk = x_ref[cols]
            return acc[0] + _mma_step(xk, w[0](cols)), acc[1] + _mma_step(xk, w[1](cols))

        zero = jnp.zeros((MMA_ROWS, g_ref.shape[-1]), jnp.float32)
        g, u = jax.lax.fori_loop(0, nk, body, (zero, zero))
        g_ref[...] = first_row(g)
        u_ref[...] = first_row(u)

    _routed_or_shared(e_ref, (wg_ref, wu_ref), shared, n_routed, run)


def _h_slab(h_refs, cols, dtype, limit):
    """h's columns `cols` for this program's row: h itself, or from gate/up partial sums [S, F] (an
    `gate_up_gemv(partials=True)`): SiLU(Σ gate) ⊙ Σ up rounded to `dtype`, as `gate_up_gemv` returns it
    (the sums clamped first for a SwiGLU limit)."""
    if len(h_refs) == 1:
        return h_refs[0][cols]
    g, u = clamp_gate_up(sum_rows(h_refs[0], cols), sum_rows(h_refs[1], cols), limit)
    return (g / (1.0 + jnp.exp(-g)) * u).astype(dtype)


def _down_mma_kernel(e_ref, *refs, bk, nk, n_routed, n_h, dtype, swiglu_limit):
    h_refs, (wd_ref, *shared, y_ref) = refs[:n_h], refs[n_h:]

    def run(w):
        def body(kk, acc):
            cols = pl.ds(kk * bk, bk)
            return acc + _mma_step(_h_slab(h_refs, cols, dtype, swiglu_limit), w[0](cols))

        acc = jax.lax.fori_loop(0, nk, body, jnp.zeros((MMA_ROWS, y_ref.shape[-1]), jnp.float32))
        y_ref[...] = first_row(acc)

    _routed_or_shared(e_ref, (wd_ref,), shared, n_routed, run)


def _gate_up_kernel(e_ref, x_ref, wg_ref, wu_ref, *refs, bk, nk, n_routed):
    *shared, g_ref, u_ref = refs
    bn = g_ref.shape[-1]

    # Partial products accumulate as [BK, BN] tiles and are summed over BK once at the end: a reduction across
    # the tile's rows at every step would cross warps (through shared memory) at every step.
    def run(w):
        def body(kk, acc):
            g, u = acc
            cols = pl.ds(kk * bk, bk)
            xk = x_ref[cols].astype(jnp.float32)[:, None]  # [BK, 1]
            return g + xk * w[0](cols).astype(jnp.float32), u + xk * w[1](cols).astype(jnp.float32)

        zero = jnp.zeros((bk, bn), jnp.float32)
        g, u = jax.lax.fori_loop(0, nk, body, (zero, zero))
        g_ref[...] = jnp.sum(g, axis=0)
        u_ref[...] = jnp.sum(u, axis=0)

    _routed_or_shared(e_ref, (wg_ref, wu_ref), shared, n_routed, run)


def _down_kernel(e_ref, *refs, bk, nk, n_routed, n_h, dtype, swiglu_limit):
    h_refs, (wd_ref, *shared, y_ref) = refs[:n_h], refs[n_h:]

    def run(w):
        def body(kk, acc):
            cols = pl.ds(kk * bk, bk)
            h = _h_slab(h_refs, cols, dtype, swiglu_limit).astype(jnp.float32)
            return acc + h[:, None] * w[0](cols).astype(jnp.float32)

        acc = jax.lax.fori_loop(0, nk, body, jnp.zeros((bk, y_ref.shape[-1]), jnp.float32))
        y_ref[...] = jnp.sum(acc, axis=0)

    _routed_or_shared(e_ref, (wd_ref,), shared, n_routed, run)


def check_slabs(name, weights, kdim, split_k, block_k, block_n, shared) -> tuple[int, int]:
    """(experts, output width) of stacked weights [E, K, N], after checking that K splits into split_k slabs of
    whole block_k steps, N into block_n tiles, and that the shared weights are [K, N]; a ValueError otherwise."""
    n_exp, _, width = weights[0].shape
    if kdim % (split_k * block_k) or width % block_n:
        raise ValueError(
            f"{name}: contraction {kdim} must be a multiple of split_k * block_k = {split_k} * {block_k} and "
            f"output width {width} of block_n = {block_n}"
        )
    if any(w.shape != (kdim, width) for w in shared):
        raise ValueError(f"{name}: shared weights {[w.shape for w in shared]} must be [{kdim}, {width}]")
    return n_exp, width


def _pair_call(
    kernel, name, e_ids, rows, weights, n_out, *, block_n, block_k, split_k, interpret, num_warps, num_stages,
    pairs_per_row=1, shared=(), shared_row_offset=0, kernel_kw=None,
):  # fmt: skip
    """Grid (pairs [+ shared rows], output tiles, contraction splits) -> n_out float32 partial sums, each
    [P (+ R), split_k, N]. Pair p reads row p // pairs_per_row (a token's k pairs share its row: no repeated
    copy of x). With `shared` weights (the shared expert's, [K, N] each) R = rows.shape[0] more programs
    follow the P pairs: program P + r runs row r + P - shared_row_offset through the shared weights.
    rows: one array [rows, K], or a tuple of them, or of partial sums [rows, S, K] (each program reads its
    row's S partials of its slab)."""
    rows = rows if isinstance(rows, tuple) else (rows,)
    p = e_ids.shape[0]
    n_rows, kdim = rows[0].shape[0], rows[0].shape[-1]
    if any(r.shape[0] != n_rows or r.shape[-1] != kdim for r in rows):
        raise ValueError(f"{name}: row inputs {[r.shape for r in rows]} must agree on rows and contraction")
    if (shared_row_offset or not shared) and n_rows * pairs_per_row != p:
        raise ValueError(f"{name}: {n_rows} rows x {pairs_per_row} pairs per row != {p} expert ids")
    if shared and not shared_row_offset and n_rows <= p:  # the rows after the P pairs' are the shared ones
        raise ValueError(f"{name}: {n_rows} rows leave none after the {p} pairs' for the shared expert")
    n_exp, width = check_slabs(name, weights, kdim, split_k, block_k, block_n, shared)
    n_shared = (p // pairs_per_row if shared_row_offset else n_rows - p) if shared else 0
    ks = kdim // split_k
    out = jax.ShapeDtypeStruct((p + n_shared, split_k, width), jnp.float32)

    def row(i):
        return jnp.where(i < p, i // pairs_per_row, i - shared_row_offset)

    def row_spec(r):
        if r.ndim == 2:
            return pl.BlockSpec((None, ks), lambda i, j, s: (row(i), s))
        return pl.BlockSpec((None, r.shape[1], ks), lambda i, j, s: (row(i), 0, s))

    return pl.pallas_call(
        functools.partial(kernel, bk=block_k, nk=ks // block_k, n_routed=p, **(kernel_kw or {})),
        grid=(p + n_shared, width // block_n, split_k),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j, s: (jnp.minimum(i, p - 1),)),
            *[row_spec(r) for r in rows],
            *[pl.BlockSpec((n_exp, ks, block_n), lambda i, j, s: (0, s, j)) for _ in weights],
            *[pl.BlockSpec((ks, block_n), lambda i, j, s: (s, j)) for _ in shared],
        ],
        out_specs=[pl.BlockSpec((None, None, block_n), lambda i, j, s: (i, s, j))] * n_out,
        out_shape=[out] * n_out,
        interpret=interpret,
        name=name,
        **triton_params(interpret, num_warps, num_stages),
    )(e_ids, *rows, *weights, *shared)


_STATIC = ("block_n", "block_k", "split_k", "mma", "interpret", "num_warps", "num_stages")


@functools.partial(jax.jit, static_argnames=(*_STATIC, "pairs_per_row", "partials", "swiglu_limit"))
def gate_up_gemv(
    e_ids, x_rows, gate, up, *, block_n, block_k, split_k=1, mma=True, interpret=False, num_warps=4, num_stages=3,
    pairs_per_row=1, shared=None, partials=False, swiglu_limit=None,
):  # fmt: skip
    """e_ids [P] int32, x_rows [P / pairs_per_row, D] (D a multiple of split_k * block_k; pair p reads row
    p // pairs_per_row), gate/up [E, D, F] (F a multiple of block_n) -> h [P, F] in x_rows.dtype:
    SiLU(x_p gate[e_p]) ⊙ (x_p up[e_p]). shared: the shared expert's (gate, up) [D, F], run for every row
    after the pairs in the same launch: h [P + rows, F]. mma: each step one tensor-core product (the row
    broadcast to 16) with the weight tiles streamed through shared memory; else CUDA-core multiply-adds.
    partials: (gate, up) partial sums [P (+ rows), split_k, F] float32 instead of h, for `down_gemv` to
    combine itself (no XLA kernel between the two launches). swiglu_limit: a static float L, gate and up sums
    clamped before they meet (`reference.clamp_gate_up`); with partials the consumer clamps (`down_gemv`'s
    swiglu_limit), so it is refused there."""
    limit = check_swiglu_limit(swiglu_limit, "gate_up_gemv")
    if partials and limit is not None:
        raise ValueError("gate_up_gemv: partials are unclamped sums; pass swiglu_limit to down_gemv, which forms h")
    g, u = _pair_call(
        _gate_up_mma_kernel if mma else _gate_up_kernel, "moe_gate_up_gemv", e_ids, x_rows, (gate, up), 2,
        block_n=block_n, block_k=block_k, split_k=split_k, interpret=interpret, num_warps=num_warps,
        num_stages=num_stages, pairs_per_row=pairs_per_row, shared=tuple(shared or ()),
        shared_row_offset=e_ids.shape[0],
    )  # fmt: skip
    if partials:
        return g, u
    g, u = clamp_gate_up(jnp.sum(g, axis=1), jnp.sum(u, axis=1), limit)
    return (jax.nn.silu(g) * u).astype(x_rows.dtype)


@functools.partial(jax.jit, static_argnames=(*_STATIC, "h_dtype", "swiglu_limit"))
def down_gemv(
    e_ids, h, down, *, block_n, block_k, split_k=1, mma=True, interpret=False, num_warps=4, num_stages=3,
    shared=None, h_dtype=None, swiglu_limit=None,
):  # fmt: skip
    """e_ids [P] int32, h [P, F] (F a multiple of split_k * block_k), down [E, F, D] (D a multiple of block_n)
    -> y [P, D] float32: h_p down[e_p] (mma as `gate_up_gemv`). shared: the shared expert's down [F, D] for
    the rows of h after the P pairs (h [P + R, F] -> y [P + R, D]). h may be `gate_up_gemv(partials=True)`'s
    (gate, up) partial sums: each program forms its slab of h from them, rounded to h_dtype, the sums clamped
    first for a static SwiGLU limit `swiglu_limit` (`reference.clamp_gate_up`; for partial sums only: a
    formed h was clamped where it was formed)."""
    parts = isinstance(h, tuple)
    limit = check_swiglu_limit(swiglu_limit, "down_gemv")
    if parts and (len(h) != 2 or h_dtype is None):
        raise ValueError("down_gemv: h as partial sums is a (gate, up) pair and needs h_dtype")
    if limit is not None and not parts:
        raise ValueError("down_gemv: swiglu_limit applies to (gate, up) partial sums; a formed h is clamped already")
    (y,) = _pair_call(
        _down_mma_kernel if mma else _down_kernel, "moe_down_gemv", e_ids, h if parts else (h,), (down,), 1,
        block_n=block_n, block_k=block_k, split_k=split_k, interpret=interpret, num_warps=num_warps,
        num_stages=num_stages, shared=tuple(shared or ()),
        kernel_kw=dict(n_h=2 if parts else 1, dtype=jnp.dtype(h_dtype or h.dtype), swiglu_limit=limit),
    )  # fmt: skip
    return jnp.sum(y, axis=1)


def auto_split_k(pairs: int, width: int, kdim: int, block_n: int, block_k: int, target: int = SPLIT_TARGET) -> int:
    """Contraction splits for `pairs` x `width / block_n` programs: doubled (while the contraction still divides
    into whole block_k slabs) until there are `target` programs — enough resident CTAs to keep weight bytes
    in flight on every SM (one token's 8 pairs alone make 8 x F / BN = 256 programs, two waves of one CTA
    per SM, each streaming its slab serially)."""
    s = 1
    while pairs * (width // block_n) * s < target and kdim % (2 * s * block_k) == 0 and s < MAX_SPLIT_K:
        s *= 2
    return s
