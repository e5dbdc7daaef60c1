"""Pallas kernels: chunked KDA prefill in two phases, the intra-chunk work parallel over all chunks and the
inter-chunk recurrence sequential per (sequence, head, tile of V columns).

Chunks of C = 64 tokens, handled as four sub-blocks of 16 rows. With G the within-chunk running sum of the
log decays (G ≤ 0, decreasing), q, k L2-normalised and q scaled:

Phase 1 (`_intra_kernel`, grid (B, N, chunks)), per chunk:
    A_qk[a, b] = Σ_k q_ak k_bk exp(G_ak − G_bk)  (a ≥ b),   A_kk[a, b] = β_a Σ_k k_ak k_bk exp(G_ak − G_bk)  (a > b)
  For a in sub-block i and b in an earlier sub-block j, with P_i = G at the row before sub-block i,
  exp(G_a − G_b) = exp(G_a − P_i) · exp(P_i − G_b): both factors are ≤ 1, so the block is one tensor-core
  product of two rescaled tiles and nothing can overflow however strong the gates. Diagonal sub-blocks are
  formed per element (masked before the exponential) in K-slices. Then the UT transform
  T = (I + A_kk)⁻¹ Diag(β) by block forward substitution (diagonal 16x16 inverses by the Neumann product
  (I − N)(I + N²)(I + N⁴)(I + N⁸)), and W = T (exp(G) ⊙ k), U = T v, q_g = exp(G) ⊙ q,
  k_g = exp(G_C − G) ⊙ k, exp(G_C).
Phase 2 (`_state_kernel`, grid (B, N, V/BV)), chunk after chunk with S [K, BV] on chip:
    V' = U − W S;   o = q_g S + A_qk V';   S ← Diag(exp(G_C)) S + k_gᵀ V'
Intermediates between the phases are float32 in HBM (W, U, q_g, k_g, A_qk).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._pallas import triton_params

CHUNK = 64
SUB = 16  # sub-block rows: the smallest tensor-core tile
CONTRACT_LAST = (((1,), (1,)), ((), ()))  # a @ bᵀ
CONTRACT_FIRST = (((0,), (0,)), ((), ()))  # aᵀ @ b


def _products(precision: str):
    prec = jax.lax.Precision.HIGHEST if precision == "ieee" else jax.lax.Precision.DEFAULT

    def dot(a, b, dims=None):
        if dims is None:
            return jnp.dot(a, b, precision=prec, preferred_element_type=jnp.float32)
        return jax.lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)

    return dot


def _intra_kernel(
    q_ref, k_ref, v_ref, g_ref, beta_ref, aqk_ref, w_ref, u_ref, qg_ref, kg_ref, gl_ref, *, scale, l2norm,
    precision, kslice,
):  # fmt: skip
    dot = _products(precision)
    dk = q_ref.shape[-1]
    nb = q_ref.shape[0] // SUB
    row = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
    eye = (row == col).astype(jnp.float32)
    lower_incl, lower_strict = row >= col, row > col

    blocks = []
    offset = jnp.zeros((dk,), jnp.float32)  # P_i: G at the row before sub-block i
    for i in range(nb):
        r = pl.ds(i * SUB, SUB)
        qr, kr = q_ref[r, :].astype(jnp.float32), k_ref[r, :].astype(jnp.float32)
        q_scale = jnp.full((SUB, 1), scale, jnp.float32)
        k_scale = jnp.ones((SUB, 1), jnp.float32)
        if l2norm:
            q_scale = q_scale * jax.lax.rsqrt(jnp.sum(qr * qr, axis=1, keepdims=True) + 1e-6)
            k_scale = jax.lax.rsqrt(jnp.sum(kr * kr, axis=1, keepdims=True) + 1e-6)
        g = g_ref[r, :].astype(jnp.float32)
        blocks.append(
            dict(
                q=qr * q_scale, k=kr * k_scale, q_scale=q_scale, k_scale=k_scale,
                G=offset[None, :] + jnp.cumsum(g, axis=0), P=offset,
                v=v_ref[r, :].astype(jnp.float32), beta=beta_ref[r].astype(jnp.float32),
            )
        )  # fmt: skip
        offset = offset + jnp.sum(g, axis=0)
    g_total = offset  # G at the chunk's last row

    a_kk = {}
    for i, bi in enumerate(blocks):
        r = pl.ds(i * SUB, SUB)
        # diagonal sub-block: exact per-element decays, masked before the exponential
        aqk_ii = jnp.zeros((SUB, SUB), jnp.float32)
        akk_ii = jnp.zeros((SUB, SUB), jnp.float32)
        for s in range(dk // kslice):
            cols = pl.ds(s * kslice, kslice)
            qs = q_ref[r, cols].astype(jnp.float32) * bi["q_scale"]
            ks = k_ref[r, cols].astype(jnp.float32) * bi["k_scale"]
            gl = jnp.cumsum(g_ref[r, cols].astype(jnp.float32), axis=0)  # the offset cancels in G_a - G_b
            decay = jnp.exp(jnp.where(lower_incl[:, :, None], gl[:, None, :] - gl[None, :, :], -jnp.inf))
            kd = ks[None, :, :] * decay
            aqk_ii += jnp.sum(qs[:, None, :] * kd, axis=2)
            akk_ii += jnp.sum(ks[:, None, :] * kd, axis=2)
        a_kk[i, i] = jnp.where(lower_strict, akk_ii * bi["beta"][:, None], 0.0)
        aqk_ref[r, pl.ds(i * SUB, SUB)] = aqk_ii
        # earlier sub-blocks: exp(G_a - G_b) = exp(G_a - P_i) exp(P_i - G_b), both factors <= 1
        q_left = bi["q"] * jnp.exp(bi["G"] - bi["P"][None, :])
        k_left = bi["k"] * jnp.exp(bi["G"] - bi["P"][None, :])
        for j in range(i):
            right = blocks[j]["k"] * jnp.exp(bi["P"][None, :] - blocks[j]["G"])
            aqk_ref[r, pl.ds(j * SUB, SUB)] = dot(q_left, right, CONTRACT_LAST)
            a_kk[i, j] = dot(k_left, right, CONTRACT_LAST) * bi["beta"][:, None]
        for j in range(i + 1, nb):
            aqk_ref[r, pl.ds(j * SUB, SUB)] = jnp.zeros((SUB, SUB), jnp.float32)

    # (I + A_kk)^-1 by block forward substitution; diagonal blocks by the Neumann product (N^16 = 0)
    inv = {}
    for i in range(nb):
        n1 = a_kk[i, i]
        n2 = dot(n1, n1)
        n4 = dot(n2, n2)
        n8 = dot(n4, n4)
        inv[i, i] = dot(dot(dot(eye - n1, eye + n2), eye + n4), eye + n8)
        for j in range(i):
            acc = dot(a_kk[i, j], inv[j, j])
            for m in range(j + 1, i):
                acc += dot(a_kk[i, m], inv[m, j])
            inv[i, j] = -dot(inv[i, i], acc)
    rhs_k = [b["beta"][:, None] * jnp.exp(b["G"]) * b["k"] for b in blocks]
    rhs_v = [b["beta"][:, None] * b["v"] for b in blocks]
    for i, bi in enumerate(blocks):
        r = pl.ds(i * SUB, SUB)
        w = dot(inv[i, 0], rhs_k[0])
        u = dot(inv[i, 0], rhs_v[0])
        for j in range(1, i + 1):
            w += dot(inv[i, j], rhs_k[j])
            u += dot(inv[i, j], rhs_v[j])
        w_ref[r, :] = w
        u_ref[r, :] = u
        qg_ref[r, :] = jnp.exp(bi["G"]) * bi["q"]
        kg_ref[r, :] = jnp.exp(g_total[None, :] - bi["G"]) * bi["k"]
    gl_ref[...] = jnp.exp(g_total)[:, None]


def _state_kernel(w_ref, u_ref, qg_ref, kg_ref, aqk_ref, gl_ref, s0_ref, o_ref, s_ref, *, nc, precision):
    dot = _products(precision)

    def body(c, s):
        rows = pl.ds(c * CHUNK, CHUNK)
        v_new = u_ref[rows, :] - dot(w_ref[rows, :], s)  # [C, BV]
        o = dot(qg_ref[rows, :], s) + dot(aqk_ref[rows, :], v_new)
        o_ref[rows, :] = o.astype(o_ref.dtype)
        return gl_ref[c] * s + dot(kg_ref[rows, :], v_new, CONTRACT_FIRST)

    s_ref[...] = jax.lax.fori_loop(0, nc, body, s0_ref[...].astype(jnp.float32))


def _summary_kernel(w_ref, u_ref, kg_ref, gl_ref, s0_ref, s_ref, *, nc, precision):
    """The state pass without outputs, on the augmented state [M | E] (see `kda_state_summary_pallas`)."""
    dot = _products(precision)

    def body(c, s):
        rows = pl.ds(c * CHUNK, CHUNK)
        v_new = u_ref[rows, :] - dot(w_ref[rows, :], s)
        return gl_ref[c] * s + dot(kg_ref[rows, :], v_new, CONTRACT_FIRST)

    s_ref[...] = jax.lax.fori_loop(0, nc, body, s0_ref[...].astype(jnp.float32))


def _intra(q, k, v, g, beta, *, scale, l2norm, precision, interpret, params):
    """Phase 1 over every chunk: (A_qk, W, U, q_g, k_g, exp(G_C) [B, chunks, N, K, 1])."""
    b, t, n, dk = q.shape
    dv = v.shape[-1]
    nc = t // CHUNK
    f32 = jnp.float32

    def chunk_spec(width):
        return pl.BlockSpec((None, CHUNK, None, width), lambda i, h, c: (i, c, h, 0))

    intra = functools.partial(_intra_kernel, scale=scale, l2norm=l2norm, precision=precision, kslice=min(dk, 16))
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
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, t, n, CHUNK), f32), jax.ShapeDtypeStruct((b, t, n, dk), f32),
            jax.ShapeDtypeStruct((b, t, n, dv), f32), jax.ShapeDtypeStruct((b, t, n, dk), f32),
            jax.ShapeDtypeStruct((b, t, n, dk), f32), jax.ShapeDtypeStruct((b, nc, n, dk, 1), f32),
        ],
        interpret=interpret,
        name="kda_chunk_intra",
        **params,
    )(q, k, v, g, beta)  # fmt: skip


def _seq_spec(t, width, tile=False):
    if tile:
        return pl.BlockSpec((None, t, None, width), lambda i, h, j: (i, 0, h, j))
    return pl.BlockSpec((None, t, None, width), lambda i, h, j: (i, 0, h, 0))


def _gate_spec(nc, dk):
    return pl.BlockSpec((None, nc, None, dk, 1), lambda i, h, j: (i, 0, h, 0, 0))


@functools.partial(
    jax.jit, static_argnames=("scale", "l2norm", "block_v", "precision", "interpret", "num_warps", "num_stages")
)
def kda_chunked_pallas(
    q, k, v, g, beta, s0, *, scale, l2norm, block_v, precision="tf32", interpret=False, num_warps=4, num_stages=2
):
    """q, k, g [B, T, N, K] (T a multiple of 64, K a power of two >= 16); v [B, T, N, V]; beta [B, T, N];
    s0 [B, N, K, V] float32 -> (o [B, T, N, V] in q.dtype, final state [B, N, K, V] float32)."""
    b, t, n, dk = q.shape
    dv = v.shape[-1]
    nc = t // CHUNK
    params = triton_params(interpret, num_warps, num_stages)
    aqk, w, u, qg, kg, gl = _intra(
        q, k, v, g, beta, scale=scale, l2norm=l2norm, precision=precision, interpret=interpret, params=params
    )
    state = pl.BlockSpec((None, None, dk, block_v), lambda i, h, j: (i, h, 0, j))
    return pl.pallas_call(
        functools.partial(_state_kernel, nc=nc, precision=precision),
        grid=(b, n, dv // block_v),
        in_specs=[
            _seq_spec(t, dk), _seq_spec(t, block_v, tile=True), _seq_spec(t, dk), _seq_spec(t, dk),
            _seq_spec(t, CHUNK), _gate_spec(nc, dk), state,
        ],
        out_specs=[_seq_spec(t, block_v, tile=True), state],
        out_shape=[jax.ShapeDtypeStruct(v.shape, q.dtype), jax.ShapeDtypeStruct(s0.shape, jnp.float32)],
        interpret=interpret,
        name="kda_chunk_state",
        **params,
    )(w, u, qg, kg, aqk, gl, s0)  # fmt: skip


@functools.partial(jax.jit, static_argnames=("l2norm", "block_v", "precision", "interpret", "num_warps", "num_stages"))
def kda_state_summary_pallas(
    k, v, g, beta, *, l2norm, block_v, precision="tf32", interpret=False, num_warps=4, num_stages=2
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
    _, w, u, _, kg, gl = _intra(
        k, k, v, g, beta, scale=1.0, l2norm=l2norm, precision=precision, interpret=interpret, params=params
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
