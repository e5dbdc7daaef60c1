"""Pallas kernel: index-based sparse MLA (absorbed form) over a paged latent pool, with an online softmax.

One program per (query, block of BH heads). It walks the query's selected positions in blocks of BK rows:
gathers the rows `[c | k_rope]` straight from the flat pool by their pool row numbers (no gathered copy in
HBM), scores them for its heads, and folds them into a running max / sum / output (flash-attention
style). Returns the latent-space output and the natural-log LSE (so partial results over disjoint index
sets merge exactly). All heads of a query read the same rows, so the head blocks of one query share them
through L2.

Generic Pallas: Triton lowering on GPU, interpret mode on CPU (tests). Loaded tiles must have power-of-two
sizes, so the latent (L) and rope (R) parts are gathered as two tiles (no rope tile, query or pool at all when
R = 0: GLM-5.3-Flash's NoPE DSA); `sparse_mla(impl="pallas")` pads
heads to a multiple of BH and the index list to a multiple of BK.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._pallas import triton_params

# static arguments of both kernels' entry points
_KNOBS = ("scale", "block_h", "block_k", "precision", "interpret", "num_warps", "num_stages", "heads_inner")


def _check_splits(name, q_latent, slots, q_splits):
    """slots hold q_splits rows per query (row r for query r // q_splits)."""
    if q_splits < 1 or slots.shape[0] != q_latent.shape[0] * q_splits:
        raise ValueError(
            f"{name}: {slots.shape[0]} slot rows for {q_latent.shape[0]} queries in q_splits={q_splits} parts"
        )


def _grid(queries: int, head_blocks: int, heads_inner: bool):
    """(grid, wrap): the launch grid and a wrapper giving index maps written as (query i, head block h) the
    grid's argument order. heads_inner: the head blocks of one query are neighbouring programs, which the
    GPU starts together, so they tend to read the query's rows while L2 holds them. Why: a small gain, larger
    at prefill, where the programs are not all resident at once; measurements in docs/performance.md#sparse-mla."""
    if heads_inner:
        return (head_blocks, queries), lambda f: lambda h, i: f(i, h)
    return (queries, head_blocks), lambda f: f


def _refs(refs, rope: int):
    """The kernel's refs (ql, qr, slots, latent rows[, scales], rope rows, out, lse); without a rope part
    (R = 0) the caller passes no q_rope and no rope rows, which come back as None."""
    if rope:
        return refs
    ql, slots, *rows, o, lse = refs
    return (ql, None, slots, *rows, None, o, lse)


def _kernel(*refs, scale, block_k, n_blocks, lat, rope, rope_off, precision):
    ql_ref, qr_ref, slots_ref, lat_ref, rope_ref, o_ref, lse_ref = _refs(refs, rope)
    prec = jax.lax.Precision.HIGHEST if precision == "ieee" else jax.lax.Precision.DEFAULT
    # "bf16": operands stay bfloat16 into the tensor cores (half the registers per gathered tile) and the
    # probabilities go to bfloat16 for the output product, as flash attention does; else float32 / TF32.
    op = jnp.bfloat16 if precision == "bf16" else jnp.float32
    ql = ql_ref[...].astype(op)  # [BH, L]
    qr = qr_ref[...].astype(op) if rope else None  # [BH, R]
    bh = ql.shape[0]
    contract = (((1,), (1,)), ((), ()))

    def body(j, carry):
        m, l_sum, acc = carry
        slots = slots_ref[pl.ds(j * block_k, block_k)]  # [BK] pool rows, -1 = unused
        valid = slots >= 0
        rows = jnp.maximum(slots, 0)
        c = lat_ref[rows, pl.ds(0, lat)].astype(op)  # [BK, L]
        s = jax.lax.dot_general(ql, c, contract, precision=prec, preferred_element_type=jnp.float32)
        if rope:
            kr = rope_ref[rows, pl.ds(rope_off, rope)].astype(op)  # [BK, R]
            s = jax.lax.dot_general(qr, kr, contract, precision=prec, preferred_element_type=jnp.float32) + s
        s = jnp.where(valid[None, :], s * scale, -jnp.inf)  # [BH, BK]
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing seen yet: keep exp() away from inf - inf
        p = jnp.exp(s - safe[:, None])
        alpha = jnp.exp(m - safe)
        l_sum = l_sum * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + jnp.dot(p.astype(op), c, precision=prec, preferred_element_type=jnp.float32)
        return m_new, l_sum, acc

    init = (
        jnp.full((bh,), -jnp.inf, jnp.float32),
        jnp.zeros((bh,), jnp.float32),
        jnp.zeros((bh, lat), jnp.float32),
    )
    m, l_sum, acc = jax.lax.fori_loop(0, n_blocks, body, init)
    empty = l_sum == 0.0
    o_ref[...] = jnp.where(empty[:, None], 0.0, acc / jnp.where(empty, 1.0, l_sum)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l_sum)))


def _kernel_fp8(*refs, scale, block_k, n_blocks, lat, rope, tile, precision):
    """FP8 latent rows (E4M3 values, one float32 scale per `tile` values) dequantized in the kernel: each
    tile's scores and output contributions are scaled by the row's tile scale. precision "bf16": the E4M3
    values go to bfloat16 (exactly: every E4M3 value is a bfloat16 one) and into the tensor cores as such,
    the probabilities times the tile scale rounded to bfloat16 for the output product; else float32 rows."""
    ql_ref, qr_ref, slots_ref, lat_ref, sc_ref, rope_ref, o_ref, lse_ref = _refs(refs, rope)
    prec = jax.lax.Precision.HIGHEST if precision == "ieee" else jax.lax.Precision.DEFAULT
    op = jnp.bfloat16 if precision == "bf16" else jnp.float32
    nt = lat // tile
    ql = [ql_ref[:, pl.ds(c * tile, tile)].astype(op) for c in range(nt)]  # [BH, tile] each
    bh = ql[0].shape[0]
    contract = (((1,), (1,)), ((), ()))

    def body(j, carry):
        m, l_sum, accs = carry
        slots = slots_ref[pl.ds(j * block_k, block_k)]
        valid = slots >= 0
        rows = jnp.maximum(slots, 0)
        s = jnp.zeros((bh, block_k), jnp.float32)
        if rope:
            qr = qr_ref[...].astype(op)
            s = jax.lax.dot_general(
                qr, rope_ref[rows, :].astype(op), contract, precision=prec, preferred_element_type=jnp.float32
            )
        vals, scales = [], []
        for c in range(nt):
            vals.append(lat_ref[rows, pl.ds(c * tile, tile)].astype(op))  # [BK, tile]
            scales.append(sc_ref[rows, c].astype(jnp.float32))  # [BK]
            part = jax.lax.dot_general(ql[c], vals[c], contract, precision=prec, preferred_element_type=jnp.float32)
            s = s + part * scales[c][None, :]
        s = jnp.where(valid[None, :], s * scale, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - safe[:, None])
        alpha = jnp.exp(m - safe)
        l_sum = l_sum * alpha + jnp.sum(p, axis=1)
        accs = tuple(
            acc * alpha[:, None]
            + jnp.dot((p * scales[c][None, :]).astype(op), vals[c], precision=prec, preferred_element_type=jnp.float32)
            for c, acc in enumerate(accs)
        )
        return m_new, l_sum, accs

    init = (
        jnp.full((bh,), -jnp.inf, jnp.float32),
        jnp.zeros((bh,), jnp.float32),
        tuple(jnp.zeros((bh, tile), jnp.float32) for _ in range(nt)),
    )
    m, l_sum, accs = jax.lax.fori_loop(0, n_blocks, body, init)
    empty = l_sum == 0.0
    denom = jnp.where(empty, 1.0, l_sum)[:, None]
    for c, acc in enumerate(accs):
        o_ref[:, pl.ds(c * tile, tile)] = jnp.where(empty[:, None], 0.0, acc / denom).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l_sum)))


@functools.partial(jax.jit, static_argnames=(*_KNOBS, "q_splits"))
def sparse_mla_fp8_pallas(
    q_latent, q_rope, slots, lat_rows, lat_scales, rope_rows, *, scale, block_h, block_k, precision, interpret,
    num_warps=4, num_stages=2, q_splits=1, heads_inner=True,
):  # fmt: skip
    """As `sparse_mla_pallas` with the latent rows in FP8: lat_rows [rows, L] E4M3, lat_scales [rows, L / tile]
    float32, rope_rows [rows, R]."""
    nq = slots.shape[0]
    _, n, lat = q_latent.shape
    rope = q_rope.shape[-1]
    k = slots.shape[1]
    _check_splits("sparse_mla_fp8_pallas", q_latent, slots, q_splits)
    tile = lat // lat_scales.shape[1]
    params = triton_params(interpret, num_warps, num_stages)
    kernel = functools.partial(
        _kernel_fp8, scale=scale, block_k=block_k, n_blocks=k // block_k, lat=lat, rope=rope, tile=tile,
        precision=precision,
    )  # fmt: skip
    grid, at = _grid(nq, n // block_h, heads_inner)
    whole = lambda x: pl.BlockSpec(x.shape, at(lambda i, h: (0, 0)))  # noqa: E731
    specs = [
        pl.BlockSpec((None, block_h, lat), at(lambda i, h: (i // q_splits, h, 0))),
        pl.BlockSpec((None, block_h, rope), at(lambda i, h: (i // q_splits, h, 0))),
        pl.BlockSpec((None, k), at(lambda i, h: (i, 0))),
        whole(lat_rows), whole(lat_scales), whole(rope_rows) if rope else None,
    ]  # fmt: skip
    args = [q_latent, q_rope, slots, lat_rows, lat_scales, rope_rows]
    keep = [i for i in range(6) if rope or i not in (1, 5)]  # R = 0: no rope query, no rope rows
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[specs[i] for i in keep],
        out_specs=[
            pl.BlockSpec((None, block_h, lat), at(lambda i, h: (i, h, 0))),
            pl.BlockSpec((None, block_h), at(lambda i, h: (i, h))),
        ],
        out_shape=[jax.ShapeDtypeStruct((nq, n, lat), q_latent.dtype), jax.ShapeDtypeStruct((nq, n), jnp.float32)],
        interpret=interpret,
        name="sparse_mla_fp8",
        **params,
    )(*[args[i] for i in keep])


@functools.partial(jax.jit, static_argnames=(*_KNOBS, "q_splits"))
def sparse_mla_pallas(
    q_latent, q_rope, slots, kv_rows, rope_rows=None, *, scale, block_h, block_k, precision, interpret, num_warps=4,
    num_stages=2, q_splits=1, heads_inner=True,
):  # fmt: skip
    """q_latent [Q, N, L], q_rope [Q, N, R] (N a multiple of block_h), slots [Q·S, K] int32 pool rows (-1 =
    none; K a multiple of block_k; S = q_splits parts of each query's rows, row r of slots for query r // S,
    so no query is copied per part), kv_rows [rows, L + R], or kv_rows [rows, L] and rope_rows [rows, R] (the
    latent and rope pools kept apart, so nothing concatenates the pools) -> (out [Q·S, N, L] in q_latent.dtype,
    lse [Q·S, N])."""
    nq = slots.shape[0]
    _, n, lat = q_latent.shape
    rope = q_rope.shape[-1]
    k = slots.shape[1]
    _check_splits("sparse_mla_pallas", q_latent, slots, q_splits)
    params = triton_params(interpret, num_warps, num_stages)
    rope_off = 0
    if rope_rows is None:  # one pool [c | k_rope]: the rope columns follow the latent ones
        rope_rows, rope_off = kv_rows, lat
    kernel = functools.partial(
        _kernel, scale=scale, block_k=block_k, n_blocks=k // block_k, lat=lat, rope=rope, rope_off=rope_off,
        precision=precision,
    )  # fmt: skip
    grid, at = _grid(nq, n // block_h, heads_inner)
    specs = [
        pl.BlockSpec((None, block_h, lat), at(lambda i, h: (i // q_splits, h, 0))),
        pl.BlockSpec((None, block_h, rope), at(lambda i, h: (i // q_splits, h, 0))),
        pl.BlockSpec((None, k), at(lambda i, h: (i, 0))),
        pl.BlockSpec(kv_rows.shape, at(lambda i, h: (0, 0))),
        pl.BlockSpec(rope_rows.shape, at(lambda i, h: (0, 0))) if rope else None,
    ]
    args = [q_latent, q_rope, slots, kv_rows, rope_rows]
    keep = [i for i in range(5) if rope or i not in (1, 4)]  # R = 0: no rope query, no rope rows
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[specs[i] for i in keep],
        out_specs=[
            pl.BlockSpec((None, block_h, lat), at(lambda i, h: (i, h, 0))),
            pl.BlockSpec((None, block_h), at(lambda i, h: (i, h))),
        ],
        out_shape=[jax.ShapeDtypeStruct((nq, n, lat), q_latent.dtype), jax.ShapeDtypeStruct((nq, n), jnp.float32)],
        interpret=interpret,
        name="sparse_mla",
        **params,
    )(*[args[i] for i in keep])
