"""Pallas kernels: chunked KDA prefill in two phases, the intra-chunk work parallel over all chunks and the
inter-chunk recurrence sequential per (sequence, head, tile of V columns).

Chunks of C = 64 tokens, handled as four sub-blocks of 16 rows. With G the within-chunk running sum of the
log decays (G ≤ 0, decreasing), q, k L2-normalised and q scaled:

Phase 0 (`_cumsum_kernel`): G, the running sum of the log decays within each chunk, float32 and in base 2
(G·log2(e)), so that every exponential below is one exp2.
Phase 1 (`_intra_kernel`, grid (B, N, chunks)), per chunk, on whole [64, 64] / [64, K] tiles:
    A_qk[a, b] = Σ_k q_ak k_bk exp(G_ak − G_bk)  (a ≥ b),   A_kk[a, b] = β_a Σ_k k_ak k_bk exp(G_ak − G_bk)  (a > b)
  Diagonal sub-blocks exactly per element, one column of all four sub-blocks per step (16 steps, key rows
  gathered), masked before the exponential. For a in sub-block i and b in an earlier one, with P_i = G at the
  row before sub-block i, exp(G_a − G_b) = exp(G_a − P_i) · exp(P_i − G_b): both factors are ≤ 1, so each i
  is one tensor-core product of two rescaled tiles and nothing can overflow however strong the gates.
  Then the UT transform T = (I + A_kk)⁻¹ Diag(β): with D the diagonal sub-blocks, X = (I + D)⁻¹ by the
  Neumann product (I − D)(I + D²)(I + D⁴)(I + D⁸) and M = X (A_kk − D) (block-strictly-lower, M⁴ = 0),
  (I + A_kk)⁻¹ = (I − M)(I + M²) X. W = T (exp(G) ⊙ k), U = T v, q_g = exp(G) ⊙ q, k_g = exp(G_C − G) ⊙ k,
  exp(G_C).
By default (INTRA = "split") phase 1 runs as two kernels with the same mathematics, `_a_kernel` (A_qk, A_kk,
q_g, k_g, exp(G_C), 16-row stripe by stripe) then `_solve_kernel` (the inverse, W, U) — see their section.
Phase 2 (`_state_kernel`, grid (B, N, V/BV)), chunk after chunk with S [K, BV] on chip:
    V' = U − W S;   o = q_g S + A_qk V';   S ← Diag(exp(G_C)) S + k_gᵀ V'
Intermediates between the phases are float32 in HBM (W, U, q_g, k_g, A_qk); all five in bfloat16 with
precision="bf16" (W, q_g, k_g, A_qk only enter bf16 products; V' = U − W S is cast to bfloat16 for its
products, so U's rounding is of the same order — fla stores U in bfloat16 too).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels._pallas import triton_params

CHUNK = 64
SUB = 16  # sub-block rows: the smallest tensor-core tile
# Parts of the intra-chunk phase; leaving some out (zeros / identity in their place) is a profiling aid only
# (`benchmarks/linear_attention.py --phases` times the phase with each part removed). Adding "remat" (fused
# phase 1 only, see `_intra_kernel`) measured no gain: 8.26 vs 8.41 ms for that kernel (H200, 32K, c2f09cb).
PARTS = frozenset({"diag", "off", "solve"})
# Phase 1 as one fused kernel ("fused", `_intra_kernel`) or two ("split", `_a_kernel` + `_solve_kernel`).
# H200, 32K tokens x 32 heads, bf16 (BENCHMARKS.md, ef660df / 99f1e83, same runs): fused 10.68 / 10.62 ms,
# split 8.57 / 8.57 (A kernel 4.78 + solve 1.78 + state 1.26 + cumsum 0.29); split with substitution 10.47;
# the split's diagonal sub-blocks as [16, 16, 32] tiles summed over K instead of its 16-step loop 14.04
# (tried at 99f1e83, removed); fla's chunk_kda 4.36-4.62.
INTRAS = ("fused", "split", "blocks", "blocks32", "blocks64")
INTRA = "blocks64"
LOG2E = 1.4426950408889634
# Warps of the intra-chunk kernel: at 4 it needed 255 registers per thread and spilled (Nsight Compute on
# the H200, 4K tokens: 12% occupancy, a third of its stalls on local memory); `num_warps` sets the state pass.
INTRA_WARPS = 8
# The split forms' (A kernel, solve kernel) warps. H200, 32K x 32 heads, bf16, each kernel alone: A "blocks64"
# 2.35 ms at 8 warps (6.14 at 4); solve 1.24 ms at 4 warps (2.22 at 8, 3.62 at 2).
SPLIT_WARPS = (8, 4)
# Software-pipelining stages of the state pass (its loads of the next chunk's tiles overlap this chunk's
# products): 4.53 ms vs 4.92 at 2 for the whole 32K prefill (H200, blocks64).
STATE_STAGES = 3
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


def _cumsum_kernel(g_ref, o_ref):
    o_ref[...] = jnp.cumsum(g_ref[...].astype(jnp.float32), axis=0) * LOG2E


def _chunk_cumsum(g, *, interpret, params):
    """G·log2(e): the running sum of the log decays within each 64-token chunk in base 2 (the kernels take
    exp2, one instruction, where exp would cost several), float32 [B, T, N, K]."""
    b, t, n, dk = g.shape
    spec = pl.BlockSpec((None, CHUNK, None, dk), lambda i, h, c: (i, c, h, 0))
    return pl.pallas_call(
        _cumsum_kernel,
        grid=(b, n, t // CHUNK),
        in_specs=[spec],
        out_specs=spec,
        out_shape=jax.ShapeDtypeStruct(g.shape, jnp.float32),
        interpret=interpret,
        name="kda_chunk_cumsum",
        **params,
    )(g)


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


def _intra_kernel(
    q_ref, k_ref, v_ref, g_ref, beta_ref, aqk_ref, w_ref, u_ref, qg_ref, kg_ref, gl_ref, *akk_ref, scale, l2norm,
    precision, kslice, parts=PARTS, solve="neumann", barrier=True,
):  # fmt: skip
    """g_ref holds G·log2(e) (`_chunk_cumsum`), so every decay below is an exp2. `akk_ref` (solve=
    "substitution" only): A_kk goes out through it and its rows are read back (after a CTA barrier on GPU)."""
    dot = _products(precision)
    dot_solve = _products("tf32" if precision == "bf16" else precision)  # the inverse's chain stays float32
    dk = q_ref.shape[-1]
    f32 = jnp.float32
    idx = jax.lax.broadcasted_iota(jnp.int32, (CHUNK,), 0)
    row = jax.lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1)
    rb, cb = row // SUB, col // SUB  # sub-block of each entry

    # Row factors only: the normalised tiles are formed after the diagonal loop so that no [C, K] tile
    # stays live across it (register pressure: the loop is most of the kernel's instructions).
    q_scale = _inv_norm(q_ref[...].astype(f32), l2norm) * scale  # [C]
    k_scale = _inv_norm(k_ref[...].astype(f32), l2norm)  # [C]

    # Diagonal sub-blocks, exact per element: column j of every sub-block at once (row a of the chunk pairs
    # with key row 16·⌊a/16⌋ + j), masked before the exponential; K in slices; on the raw q, k (the row
    # and column norms are applied after the loop).
    def diag(j, carry):
        dqk, dkk = carry
        src = (idx // SUB) * SUB + j  # [C] the key row each row pairs with
        live = (idx % SUB) >= j
        vq = jnp.zeros((CHUNK,), f32)
        vk = jnp.zeros((CHUNK,), f32)
        for s in range(dk // kslice):
            cols = pl.ds(s * kslice, kslice)
            e = jnp.exp2(jnp.where(live[:, None], g_ref[:, cols] - g_ref[src, cols], -jnp.inf))
            kd = k_ref[src, cols].astype(f32) * e
            vq += jnp.sum(q_ref[:, cols].astype(f32) * kd, axis=1)
            vk += jnp.sum(k_ref[:, cols].astype(f32) * kd, axis=1)
        hit = col == rb * SUB + j
        return jnp.where(hit, vq[:, None], dqk), jnp.where(hit, vk[:, None], dkk)

    zeros = jnp.zeros((CHUNK, CHUNK), f32)
    a_qk, a_kk = jax.lax.fori_loop(0, SUB, diag, (zeros, zeros)) if "diag" in parts else (zeros, zeros)
    a_qk = a_qk * q_scale[:, None] * k_scale[None, :]
    a_kk = a_kk * k_scale[:, None] * k_scale[None, :]

    q = q_ref[...].astype(f32) * q_scale[:, None]
    k = k_ref[...].astype(f32) * k_scale[:, None]
    G = g_ref[...]  # [C, K] float32: G·log2(e), G ≤ 0 decreasing within the chunk
    beta = beta_ref[...].astype(f32)

    # Earlier sub-blocks: for a in sub-block i and b before it, with P_i = G at the row before sub-block i,
    # exp(G_a − G_b) = exp(G_a − P_i) · exp(P_i − G_b), both ≤ 1 on the entries kept (the min(·, 0) only
    # touches entries masked away): one tensor-core product per i.
    for i in range(1, CHUNK // SUB if "off" in parts else 1):
        p_i = g_ref[i * SUB - 1, :][None, :]  # [1, K]
        left = jnp.exp2(jnp.minimum(G - p_i, 0.0))
        right = k * jnp.exp2(jnp.minimum(p_i - G, 0.0))
        keep = (rb == i) & (cb < i)
        a_qk += jnp.where(keep, dot(q * left, right, CONTRACT_LAST), 0.0)
        a_kk += jnp.where(keep, dot(k * left, right, CONTRACT_LAST), 0.0)
    aqk_ref[...] = a_qk.astype(aqk_ref.dtype)
    a_kk = jnp.where(row > col, a_kk * beta[:, None], 0.0)

    def _gated_outputs(q, k, G):  # what the state pass reads besides A_qk, W, U: no part of the inverse
        g_last = g_ref[CHUNK - 1, :]  # [K]
        qg_ref[...] = (jnp.exp2(G) * q).astype(qg_ref.dtype)
        kg_ref[...] = (jnp.exp2(g_last[None, :] - G) * k).astype(kg_ref.dtype)
        gl_ref[...] = jnp.exp2(g_last)[:, None]

    # parts "remat" (opt-in; measured no faster): the gated outputs are written before the inverse, and k, G are read
    # again after it, so q, k, G ([C, K] float32 tiles, 3 x 32 registers a thread at 8 warps) are not live
    # across the inverse's chain — the kernel ran at 255 registers with spills (Nsight Compute).
    remat = "remat" in parts
    if remat:
        _gated_outputs(q, k, G)
        del q

    # T = (I + A_kk)⁻¹ (`_unit_lower_inverse`); substitution reads A's rows back from memory, written through
    # akk_ref (after a CTA barrier on GPU)
    t_inv = jnp.eye(CHUNK, dtype=f32)
    if "solve" in parts:
        if solve == "substitution":
            akk_ref[0][...] = a_kk
            if barrier:
                pltriton.debug_barrier()
        t_inv = _unit_lower_inverse(a_kk, dot_solve, solve, lambda i: akk_ref[0][i, :])

    if remat:  # k and G again from memory (the chunk's tiles, just read: L2): nothing [C, K] spans the solve
        k = k_ref[...].astype(f32) * k_scale[:, None]
        G = g_ref[...]
    else:
        _gated_outputs(q, k, G)
    decay = jnp.exp2(G)
    w_ref[...] = dot(t_inv, beta[:, None] * decay * k).astype(w_ref.dtype)
    u_ref[...] = dot(t_inv, beta[:, None] * v_ref[...].astype(f32)).astype(u_ref.dtype)


def _state_kernel(*refs, nc, precision, packed):
    """The state pass over one (row, head, V-block). Packed sequences (`packed`): chunk_first / chunk_last
    [nc] int32 name the sequence a chunk starts / ends (-1: none); the state is reset to that sequence's
    initial state where one starts and written to its final state where one ends."""
    if packed:
        first_ref, last_ref, w_ref, u_ref, qg_ref, kg_ref, aqk_ref, gl_ref, s0_ref, o_ref, s_ref = refs
    else:
        w_ref, u_ref, qg_ref, kg_ref, aqk_ref, gl_ref, s0_ref, o_ref, s_ref = refs
    dot = _products(precision)

    def body(c, s):
        if packed:
            start = first_ref[c]
            s = jax.lax.cond(start >= 0, lambda: s0_ref[jnp.maximum(start, 0)].astype(jnp.float32), lambda: s)
        rows = pl.ds(c * CHUNK, CHUNK)
        v_new = u_ref[rows, :] - dot(w_ref[rows, :], s)  # [C, BV]
        o = dot(qg_ref[rows, :], s) + dot(aqk_ref[rows, :], v_new)
        o_ref[rows, :] = o.astype(o_ref.dtype)
        s = gl_ref[c] * s + dot(kg_ref[rows, :], v_new, CONTRACT_FIRST)
        if packed:
            end = last_ref[c]

            @pl.when(end >= 0)
            def _():
                s_ref[jnp.maximum(end, 0)] = s

        return s

    if packed:  # every sequence's first chunk loads its own start state
        jax.lax.fori_loop(0, nc, body, jnp.zeros(s_ref.shape[1:], jnp.float32))
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


def _intra(
    q, k, v, g, beta, *, scale, l2norm, precision, interpret, num_warps=None, parts=PARTS, solve="neumann",
    intra=INTRA,
):  # fmt: skip
    """Phase 1 over every chunk: (A_qk, W, U, q_g, k_g, exp(G_C) [B, chunks, N, K, 1]); intra="split" runs it
    as two kernels (`_intra_split`)."""
    if intra != "fused" and intra in INTRAS:
        blocks = 0 if intra == "split" else int(intra[6:] or SUB)  # rows of the diagonal blocks
        return _intra_split(
            q, k, v, g, beta, scale=scale, l2norm=l2norm, precision=precision, interpret=interpret,
            num_warps=num_warps or SPLIT_WARPS, parts=parts, solve=solve, blocks=blocks,
        )  # fmt: skip
    if intra != "fused":
        raise ValueError(f"kda_chunked_pallas: intra={intra!r} must be one of {INTRAS}")
    params = triton_params(interpret, num_warps or INTRA_WARPS, 2)
    b, t, n, dk = q.shape
    dv = v.shape[-1]
    nc = t // CHUNK
    f32 = jnp.float32

    def chunk_spec(width):
        return pl.BlockSpec((None, CHUNK, None, width), lambda i, h, c: (i, c, h, 0))

    g = _chunk_cumsum(g, interpret=interpret, params=params)
    intra = functools.partial(
        _intra_kernel, scale=scale, l2norm=l2norm, precision=precision, kslice=min(dk, 64), parts=parts,
        solve=solve, barrier=not interpret,
    )  # fmt: skip
    extra = solve == "substitution"  # A_kk as an output: written, then read back row by row
    # A_qk, W, q_g and k_g only ever enter products: with bf16 products they are stored as bf16 (the cast the
    # state pass would make, made once; half the bytes written here and read there). U stays float32.
    inter = jnp.bfloat16 if precision == "bf16" else f32
    return pl.pallas_call(
        intra,
        grid=(b, n, nc),
        in_specs=[
            chunk_spec(dk), chunk_spec(dk), chunk_spec(dv), chunk_spec(dk),
            pl.BlockSpec((None, CHUNK, None), lambda i, h, c: (i, c, h)),
        ],
        out_specs=[
            chunk_spec(CHUNK), chunk_spec(dk), chunk_spec(dv), chunk_spec(dk), chunk_spec(dk),
            pl.BlockSpec((None, None, None, dk, 1), lambda i, h, c: (i, c, h, 0, 0)),
        ] + [chunk_spec(CHUNK)] * int(extra),
        out_shape=[
            jax.ShapeDtypeStruct((b, t, n, CHUNK), inter), jax.ShapeDtypeStruct((b, t, n, dk), inter),
            jax.ShapeDtypeStruct((b, t, n, dv), inter), jax.ShapeDtypeStruct((b, t, n, dk), inter),
            jax.ShapeDtypeStruct((b, t, n, dk), inter), jax.ShapeDtypeStruct((b, nc, n, dk, 1), f32),
        ] + [jax.ShapeDtypeStruct((b, t, n, CHUNK), f32)] * int(extra),
        interpret=interpret,
        name="kda_chunk_intra",
        **params,
    )(q, k, v, g, beta)[:6]  # fmt: skip


# ---------------------------------------------------------------- phase 1 as two kernels (intra="split")
#
# The fused `_intra_kernel` keeps the chunk's [C, C] and [C, K] tiles live across the diagonal loop, the
# off-diagonal products, the inverse and W / U; on the H200 it is ~8.4 of ~10 ms of a 32K-token prefill, and
# its parts alone add up to far less than the whole (register pressure: 255 registers, spills). Split in
# two, each kernel holds a fraction of that state:
#   `_a_kernel`: A_qk and β-scaled strict-lower A_kk (float32, through HBM), q_g, k_g, exp(G_C) — one 16-row
#   stripe of the chunk at a time: its diagonal sub-block exactly per element (a 16-step loop over [16, K]
#   tiles, each key row broadcast: no gathered rows), its earlier sub-blocks as one [16, K] x [K, C]
#   product (rescaled both sides at the row before the stripe, as in the fused kernel, columns >= the
#   stripe masked away);
#   `_solve_kernel`: (I + A_kk)⁻¹ (Neumann chain, or substitution over A_kk's rows read from HBM) and
#   W = T (β exp(G) ⊙ k), U = T (β v).


def _a_kernel(
    q_ref, k_ref, g_ref, beta_ref, aqk_ref, akk_ref, qg_ref, kg_ref, gl_ref, *, scale, l2norm, precision, parts
):  # fmt: skip
    dot = _products(precision)
    f32 = jnp.float32
    r16 = jax.lax.broadcasted_iota(jnp.int32, (SUB,), 0)
    row = jax.lax.broadcasted_iota(jnp.int32, (SUB, CHUNK), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (SUB, CHUNK), 1)

    def inv_norm(x):  # [R, K] -> [R]
        return _inv_norm(x, l2norm)

    g_last = g_ref[CHUNK - 1, :]  # [K]
    gl_ref[...] = jnp.exp2(g_last)[:, None]
    k_scale = inv_norm(k_ref[...].astype(f32))  # [C]: the whole chunk's keys enter every stripe's products
    for i in range(CHUNK // SUB):  # one 16-row stripe at a time: nothing [C, K] outlives its stripe
        rows = pl.ds(i * SUB, SUB)
        q_raw = q_ref[rows, :].astype(f32)
        k_raw = k_ref[rows, :].astype(f32)
        qs = inv_norm(q_raw) * scale  # [16]
        ks = inv_norm(k_raw)
        gi = g_ref[rows, :]  # [16, K] G·log2(e)
        qg_ref[rows, :] = (jnp.exp2(gi) * q_raw * qs[:, None]).astype(qg_ref.dtype)
        kg_ref[rows, :] = (jnp.exp2(g_last[None, :] - gi) * k_raw * ks[:, None]).astype(kg_ref.dtype)

        def diag(j, carry, i=i, q_raw=q_raw, k_raw=k_raw, gi=gi):
            dqk, dkk = carry
            src = i * SUB + j
            kj = k_ref[src, :].astype(f32)  # [K] raw; its norm is applied with the stripe's below
            e = jnp.exp2(jnp.where((r16 >= j)[:, None], gi - g_ref[src, :][None, :], -jnp.inf))
            kd = kj[None, :] * e
            hit = col == src
            dqk = jnp.where(hit, jnp.sum(q_raw * kd, axis=1)[:, None], dqk)
            return dqk, jnp.where(hit, jnp.sum(k_raw * kd, axis=1)[:, None], dkk)

        zeros = jnp.zeros((SUB, CHUNK), f32)
        a_qk, a_kk = jax.lax.fori_loop(0, SUB, diag, (zeros, zeros)) if "diag" in parts else (zeros, zeros)
        a_qk = a_qk * qs[:, None] * k_scale[None, :]
        a_kk = a_kk * ks[:, None] * k_scale[None, :]
        if i and "off" in parts:
            # earlier sub-blocks: exp(G_a − G_b) = exp(G_a − P) · exp(P − G_b) with P = G at the row before the
            # stripe, both ≤ 1 on the entries kept
            p = g_ref[i * SUB - 1, :][None, :]  # [1, K]
            left = jnp.exp2(gi - p)
            right = k_ref[...].astype(f32) * k_scale[:, None] * jnp.exp2(jnp.minimum(p - g_ref[...], 0.0))
            keep = col < i * SUB
            a_qk += jnp.where(keep, dot(q_raw * qs[:, None] * left, right, CONTRACT_LAST), 0.0)
            a_kk += jnp.where(keep, dot(k_raw * ks[:, None] * left, right, CONTRACT_LAST), 0.0)
        aqk_ref[rows, :] = a_qk.astype(aqk_ref.dtype)
        beta = beta_ref[rows].astype(f32)
        akk_ref[rows, :] = jnp.where(col < row + i * SUB, a_kk * beta[:, None], 0.0)


def _a_kernel_blocks(
    q_ref, k_ref, g_ref, beta_ref, aqk_ref, akk_ref, qg_ref, kg_ref, gl_ref, *, scale, l2norm, precision, parts,
    diag=SUB,
):  # fmt: skip
    """`_a_kernel`'s outputs with every sub-block of A as tensor-core products (intra="blocks", "blocks32",
    "blocks64"; `_a_blocks`)."""
    _a_blocks(q_ref, k_ref, g_ref, beta_ref, aqk_ref, akk_ref, scale=scale, l2norm=l2norm, precision=precision,
              parts=parts, diag=diag)  # fmt: skip
    _gated_tiles(q_ref, k_ref, g_ref, qg_ref, kg_ref, gl_ref, scale=scale, l2norm=l2norm)


def _normed_rows(q_ref, k_ref, start, n, *, scale, l2norm):
    """Rows [start, start + n) of the chunk: L2-normalised q (times scale) and k, float32 [n, K]."""
    q = q_ref[pl.ds(start, n), :].astype(jnp.float32)
    k = k_ref[pl.ds(start, n), :].astype(jnp.float32)
    return q * (_inv_norm(q, l2norm) * scale)[:, None], k * _inv_norm(k, l2norm)[:, None]


def _gated_tiles(q_ref, k_ref, g_ref, qg_ref, kg_ref, gl_ref, *, scale, l2norm):
    """What the state pass reads besides A_qk, W, U: q_g = exp(G) ⊙ q, k_g = exp(G_C − G) ⊙ k, exp(G_C)."""
    g_last = g_ref[CHUNK - 1, :]  # [K]
    gl_ref[...] = jnp.exp2(g_last)[:, None]
    for s in range(0, CHUNK, SUB):
        rows = pl.ds(s, SUB)
        q, k = _normed_rows(q_ref, k_ref, s, SUB, scale=scale, l2norm=l2norm)
        gs = g_ref[rows, :]
        qg_ref[rows, :] = (jnp.exp2(gs) * q).astype(qg_ref.dtype)
        kg_ref[rows, :] = (jnp.exp2(g_last[None, :] - gs) * k).astype(kg_ref.dtype)


def _a_blocks(q_ref, k_ref, g_ref, beta_ref, aqk_ref, akk_ref, *, scale, l2norm, precision, parts, diag):
    """A_qk and β-scaled strict-lower A_kk of one chunk, every sub-block as tensor-core products; g_ref holds
    G·log2(e).

    A pair of rows a > b is split by exactly one level of a binary hierarchy over the chunk (blocks of 64,
    32, 16, 8, 4, 2): the level whose block holds both, a in its upper half and b in its lower half. With P
    the G row at the middle of that block (the last row of its lower half), exp(G_a − G_b) =
    exp(G_a − P) · exp(P − G_b) with both factors ≤ 1 — nothing overflows however strong the gates, and a
    factor that underflows bounds the exact value below it. Levels of blocks larger than `diag` rows are
    the chunk's off-diagonal blocks (one product each, written in place); inside each diagonal
    [diag, diag] block, the finer levels share one tile per level, E = exp(−|G − P(row)|) (the left factor
    on upper-half rows, the right one on lower-half rows), one masked [diag, K] x [K, diag] product per
    level, plus the exact a = b term of A_qk. Each block of the outputs is stored once (no element twice:
    no ordering between threads' stores is needed)."""
    dot = _products(precision)
    f32 = jnp.float32
    r = jax.lax.broadcasted_iota(jnp.int32, (diag,), 0)
    ra = jax.lax.broadcasted_iota(jnp.int32, (diag, diag), 0)
    rb = jax.lax.broadcasted_iota(jnp.int32, (diag, diag), 1)

    normed = functools.partial(_normed_rows, q_ref, k_ref, scale=scale, l2norm=l2norm)

    def store(a0, b0, n, a_qk, a_kk):  # block rows [a0, a0 + n) x columns [b0, b0 + n); A_kk rows times β
        beta = beta_ref[pl.ds(a0, n)].astype(f32)
        aqk_ref[pl.ds(a0, n), pl.ds(b0, n)] = a_qk.astype(aqk_ref.dtype)
        akk_ref[pl.ds(a0, n), pl.ds(b0, n)] = a_kk * beta[:, None]

    def cross(a0, n):  # rows [a0, a0 + n) against the n rows just before them
        b0 = a0 - n
        zero = jnp.zeros((n, n), f32)
        aqk_ref[pl.ds(b0, n), pl.ds(a0, n)] = zero.astype(aqk_ref.dtype)  # the mirror block, above the diagonal
        akk_ref[pl.ds(b0, n), pl.ds(a0, n)] = zero
        if "off" not in parts:
            return store(a0, b0, n, zero, zero)
        p = g_ref[a0 - 1, :][None, :]  # [1, K]
        qa, ka = normed(a0, n)
        _, kb = normed(b0, n)
        left = jnp.exp2(g_ref[pl.ds(a0, n), :] - p)  # ≤ 1: G decreases
        right = kb * jnp.exp2(p - g_ref[pl.ds(b0, n), :])  # ≤ 1
        store(a0, b0, n, dot(qa * left, right, CONTRACT_LAST), dot(ka * left, right, CONTRACT_LAST))

    def diagonal(s):  # the [diag, diag] block of rows [s, s + diag)
        q, k = normed(s, diag)
        a_qk = jnp.where(ra == rb, dot(q, k, CONTRACT_LAST), 0.0)  # a = b: no decay
        a_kk = jnp.zeros((diag, diag), f32)
        if "diag" in parts:
            gs = g_ref[pl.ds(s, diag), :]  # [diag, K]
            h = diag // 2
            while h:
                ref_row = s + (r // (2 * h)) * (2 * h) + h - 1  # [diag] the middle of each row's 2h-block
                e = jnp.exp2(-jnp.abs(gs - g_ref[ref_row, :]))
                qe, ke = q * e, k * e
                keep = (ra // (2 * h) == rb // (2 * h)) & (ra % (2 * h) >= h) & (rb % (2 * h) < h)
                a_qk += jnp.where(keep, dot(qe, ke, CONTRACT_LAST), 0.0)
                a_kk += jnp.where(keep, dot(ke, ke, CONTRACT_LAST), 0.0)
                h //= 2
        store(s, s, diag, a_qk, a_kk)

    for s in range(0, CHUNK, diag):
        diagonal(s)
    n = CHUNK // 2
    while n >= diag:  # the coarse levels: blocks of 2n rows, upper half against lower half
        for a0 in range(n, CHUNK, 2 * n):
            cross(a0, n)
        n //= 2


def _solve_kernel(k_ref, v_ref, g_ref, beta_ref, akk_ref, w_ref, u_ref, *, l2norm, precision, solve, parts):
    dot = _products(precision)
    dot_solve = _products("tf32" if precision == "bf16" else precision)  # the inverse's chain stays float32
    f32 = jnp.float32
    t_inv = jnp.eye(CHUNK, dtype=f32)
    if "solve" in parts:  # A_kk is this kernel's input: substitution reads its rows without a barrier
        t_inv = _unit_lower_inverse(akk_ref[...], dot_solve, solve, lambda i: akk_ref[i, :])
    k = k_ref[...].astype(f32)
    k = k * _inv_norm(k, l2norm)[:, None]
    beta = beta_ref[...].astype(f32)[:, None]
    w_ref[...] = dot(t_inv, beta * jnp.exp2(g_ref[...]) * k).astype(w_ref.dtype)
    u_ref[...] = dot(t_inv, beta * v_ref[...].astype(f32)).astype(u_ref.dtype)


def _chunk_spec(width):
    return pl.BlockSpec((None, CHUNK, None, width), lambda i, h, c: (i, c, h, 0))


_BETA_SPEC = pl.BlockSpec((None, CHUNK, None), lambda i, h, c: (i, c, h))


def _a_call(q, k, g, beta, *, scale, l2norm, precision, interpret, num_warps, parts, blocks):
    """`_a_kernel` (`_a_kernel_blocks` with `blocks`) over every chunk; g is G·log2(e) (`_chunk_cumsum`) ->
    (A_qk, β-scaled A_kk float32, q_g, k_g, exp(G_C))."""
    b, t, n, dk = q.shape
    nc = t // CHUNK
    inter = jnp.bfloat16 if precision == "bf16" else jnp.float32
    kernel = functools.partial(_a_kernel_blocks, diag=blocks) if blocks else _a_kernel
    return pl.pallas_call(
        functools.partial(kernel, scale=scale, l2norm=l2norm, precision=precision, parts=parts),
        grid=(b, n, nc),
        in_specs=[_chunk_spec(dk), _chunk_spec(dk), _chunk_spec(dk), _BETA_SPEC],
        out_specs=[
            _chunk_spec(CHUNK), _chunk_spec(CHUNK), _chunk_spec(dk), _chunk_spec(dk),
            pl.BlockSpec((None, None, None, dk, 1), lambda i, h, c: (i, c, h, 0, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, t, n, CHUNK), inter), jax.ShapeDtypeStruct((b, t, n, CHUNK), jnp.float32),
            jax.ShapeDtypeStruct((b, t, n, dk), inter), jax.ShapeDtypeStruct((b, t, n, dk), inter),
            jax.ShapeDtypeStruct((b, nc, n, dk, 1), jnp.float32),
        ],
        interpret=interpret,
        name="kda_chunk_a",
        **triton_params(interpret, num_warps, 2),
    )(q, k, g, beta)  # fmt: skip


def _solve_call(k, v, g, beta, akk, *, l2norm, precision, interpret, num_warps, parts, solve):
    """`_solve_kernel` over every chunk -> (W, U)."""
    b, t, n, dk = k.shape
    dv = v.shape[-1]
    inter = jnp.bfloat16 if precision == "bf16" else jnp.float32
    return pl.pallas_call(
        functools.partial(_solve_kernel, l2norm=l2norm, precision=precision, solve=solve, parts=parts),
        grid=(b, n, t // CHUNK),
        in_specs=[_chunk_spec(dk), _chunk_spec(dv), _chunk_spec(dk), _BETA_SPEC, _chunk_spec(CHUNK)],
        out_specs=[_chunk_spec(dk), _chunk_spec(dv)],
        out_shape=[jax.ShapeDtypeStruct((b, t, n, dk), inter), jax.ShapeDtypeStruct((b, t, n, dv), inter)],
        interpret=interpret,
        name="kda_chunk_solve",
        **triton_params(interpret, num_warps, 2),
    )(k, v, g, beta, akk)  # fmt: skip


def _intra_split(q, k, v, g, beta, *, scale, l2norm, precision, interpret, num_warps, parts, solve, blocks=0):
    """Phase 1 as `_a_kernel` (`_a_kernel_blocks` with `blocks`) then `_solve_kernel`: the same six outputs as
    `_intra`. num_warps: one count for both kernels, or an (A kernel, solve kernel) pair."""
    a_warps, solve_warps = num_warps if isinstance(num_warps, tuple) else (num_warps, num_warps)
    g = _chunk_cumsum(g, interpret=interpret, params=triton_params(interpret, a_warps, 2))
    aqk, akk, qg, kg, gl = _a_call(
        q, k, g, beta, scale=scale, l2norm=l2norm, precision=precision, interpret=interpret, num_warps=a_warps,
        parts=parts, blocks=blocks,
    )  # fmt: skip
    w, u = _solve_call(
        k, v, g, beta, akk, l2norm=l2norm, precision=precision, interpret=interpret, num_warps=solve_warps,
        parts=parts, solve=solve,
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
        "intra",
    ),
)
def kda_chunked_pallas(
    q, k, v, g, beta, s0, *, scale, l2norm, block_v, precision="tf32", interpret=False, num_warps=4,
    num_stages=STATE_STAGES, solve="neumann", chunk_first=None, chunk_last=None, parts=PARTS, intra=INTRA,
):  # fmt: skip
    """q, k, g [B, T, N, K] (T a multiple of 64, K a power of two >= 16); v [B, T, N, V]; beta [B, T, N];
    s0 [B, N, K, V] float32 -> (o [B, T, N, V] in q.dtype, final state [B, N, K, V] float32).

    Packed sequences: with chunk_first / chunk_last [T / 64] int32 (the sequence whose first / last chunk
    each chunk is, -1 for none), B = 1 holds S sequences each starting at a chunk boundary (zero-padded to
    whole chunks: g = 0, beta = 0 leave the state as it is); s0 is then [S, N, K, V] and the final states
    come back per sequence — a sequence with no chunk keeps its s0 (the final states alias s0's buffer)."""
    b, t, n, dk = q.shape
    dv = v.shape[-1]
    nc = t // CHUNK
    packed = chunk_first is not None
    params = triton_params(interpret, num_warps, num_stages)
    aqk, w, u, qg, kg, gl = _intra(
        q, k, v, g, beta, scale=scale, l2norm=l2norm, precision=precision, interpret=interpret, solve=solve,
        parts=parts, intra=intra,
    )  # fmt: skip
    if packed:
        if b != 1 or chunk_first.shape != (nc,) or chunk_last.shape != (nc,):
            raise ValueError(
                f"kda_chunked_pallas: packed sequences need a batch of one and [{nc}] chunk maps, got batch {b}, "
                f"chunk_first {chunk_first.shape}, chunk_last {chunk_last.shape}"
            )
        state = pl.BlockSpec((s0.shape[0], None, dk, block_v), lambda i, h, j: (0, h, 0, j))
        chunk_map = [pl.BlockSpec((nc,), lambda i, h, j: (0,))] * 2
        extra = (chunk_first.astype(jnp.int32), chunk_last.astype(jnp.int32))
    else:
        state = pl.BlockSpec((None, None, dk, block_v), lambda i, h, j: (i, h, 0, j))
        chunk_map, extra = [], ()
    return pl.pallas_call(
        functools.partial(_state_kernel, nc=nc, precision=precision, packed=packed),
        grid=(b, n, dv // block_v),
        in_specs=[
            *chunk_map, _seq_spec(t, dk), _seq_spec(t, block_v, tile=True), _seq_spec(t, dk), _seq_spec(t, dk),
            _seq_spec(t, CHUNK), _gate_spec(nc, dk), state,
        ],
        out_specs=[_seq_spec(t, block_v, tile=True), state],
        out_shape=[jax.ShapeDtypeStruct(v.shape, q.dtype), jax.ShapeDtypeStruct(s0.shape, jnp.float32)],
        input_output_aliases={len(extra) + 6: 1} if packed else {},
        interpret=interpret,
        name="kda_chunk_state",
        **params,
    )(*extra, w, u, qg, kg, aqk, gl, s0.astype(jnp.float32))  # fmt: skip


@functools.partial(jax.jit, static_argnames=("l2norm", "block_v", "precision", "interpret", "num_warps", "num_stages"))
def kda_state_summary_pallas(
    k, v, g, beta, *, l2norm, block_v, precision="tf32", interpret=False, num_warps=4, num_stages=STATE_STAGES
):
    """The affine map of a sequence shard, S_end = M S_start + E (ARCH_SPEC §2), from the same two phases.

    The state pass is affine in S: S ← M_c S + k_gᵀ U with M_c S = exp(G_C) ⊙ S − k_gᵀ (W S). Running it on
    the augmented state [M | E] [K, K + V], started from [I | 0], with U replaced by [0 | U], leaves
    [M | E] at the end. k, g [B, T, N, K]; v [B, T, N, V]; beta [B, T, N] (same constraints as
    `kda_chunked_pallas`, K + V a multiple of block_v) -> (M [B, N, K, K], E [B, N, K, V]) float32."""
    b, t, n, dk = k.shape
    dv = v.shape[-1]
    nc = t // CHUNK
    params = triton_params(interpret, num_warps, num_stages)
    _, w, u, _, kg, gl = _intra(k, k, v, g, beta, scale=1.0, l2norm=l2norm, precision=precision, interpret=interpret)
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
