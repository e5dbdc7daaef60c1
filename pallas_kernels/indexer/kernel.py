"""Pallas kernels: lightning-indexer scores straight from the paged key pool.

`indexer_scores_pallas` (decode: few queries) runs one program per (sequence b, query t, run of `steps`
blocks of BS key positions): the query's heads are loaded once and the program walks its blocks. For each
block it gathers the key rows from the flat pool by their pool row numbers, dequantizes MXFP8 rows in the
kernel when the pool is quantized (each whole E4M3 row in one gather, times 2^(e − 127) per 32-value block, in
registers), scores all indexer heads on the tensor cores and reduces over heads with their weights, applying the
causal / length mask:
    I[t, s] = Σ_h w_h(t) ReLU(scale · q_h(t) · k(s))     (−inf where s > pos(t) or s ≥ kv_length)
Key blocks wholly past the query's position or the sequence's length are written as -inf without being
read. The pool rows come from a [B, S] slot array, or (`page_size`, as `indexer_topk` calls it) straight from
the page table, so no XLA kernel writes slots before it; with `stats` it also writes what the split selection
starts from (each program's score statistics and the query's visible prefix), so a decode step's indexer is
this kernel and the selection's own kernels, nothing between. The products are [keys, heads] tiles
(`keys_major`, the API's choice) so the weighted sum over heads stays within a warp's lanes. Only the
head-weighted scores [B, T, S] leave the kernel (never the per-head [B, T, N, S]); the Top-K over them is
chosen in `indexer_topk(impl="pallas")` (`select_kernel`, `select_split` or `lax.top_k`), block of queries by
block of queries.

`indexer_scores_tiled_pallas` (prefill: many queries) computes the same scores one [BQ, BK] tile per program:
the key tile is gathered (and MXFP8-dequantized) once and multiplied by each head's [BQ, H] queries, so a
key row is read once per query tile rather than once per query; tiles past every query of the tile are
written -inf unread.

Products: `precision` "bf16" multiplies q and the keys in bfloat16 (MXFP8 values are exact in it) with
float32 accumulation, "tf32" / "ieee" in float32.

Generic Pallas: Triton lowering on GPU, interpret mode on CPU (tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._pallas import pow2, triton_params
from pallas_kernels.indexer.select_kernel import finite_stats_init, finite_stats_step
from pallas_kernels.indexer.select_split import STATS, stats_row

MX_BLOCK = 32
_CONTRACT = (((1,), (1,)), ((), ()))  # [M, H] x [N, H] -> [M, N]


def _products(precision: str):
    """(lax precision, the products' input dtype) for a `precision` knob."""
    prec = jax.lax.Precision.HIGHEST if precision == "ieee" else jax.lax.Precision.DEFAULT
    return prec, jnp.bfloat16 if precision == "bf16" else jnp.float32


def _with_pool(in_specs, args, kv_rows, kv_scales):
    """The flat key pool (and its MXFP8 scales) whole to every program: rows are gathered by number."""
    pools = [kv_rows] + ([] if kv_scales is None else [kv_scales])
    specs = [pl.BlockSpec(x.shape, lambda *_: (0, 0)) for x in pools]
    return in_specs + specs, args + pools


def _dequantized_rows(kv_ref, ks_ref, rows, dtype):
    """The pool rows `rows` [BS] of MXFP8 keys as [BS, H] `dtype`: each row's H E4M3 values in one gather,
    times 2^(e - 127) of its 32-value block (E8M0 bits e, each block's put in place by selects).
    Exact in bfloat16 (three mantissa bits times a power of two) while the product stays a normal number."""
    block = jax.lax.broadcasted_iota(jnp.int32, (rows.shape[0], kv_ref.shape[1]), 1) // MX_BLOCK
    e = jnp.zeros(block.shape, jnp.float32)
    for c in range(ks_ref.shape[1]):
        e = jnp.where(block == c, ks_ref[rows, c].astype(jnp.float32)[:, None], e)
    return (kv_ref[rows, :].astype(jnp.float32) * jnp.exp2(e - 127.0)).astype(dtype)


def _kernel(
    q_ref, w_ref, pos_ref, len_ref, slots_ref, kv_ref, *rest, scale, block_s, steps, mx, precision, stats, keys_major,
    page_size,
):  # fmt: skip
    ks_ref = rest[0] if mx else None
    out_ref = rest[int(mx)]
    stats_ref, limit_ref = rest[-2:] if stats else (None, None)
    prec, cdt = _products(precision)
    q = q_ref[...].astype(cdt)  # the query's heads [N, H], read once for all of this program's key blocks
    w = w_ref[...].astype(jnp.float32)  # [N]
    first = pl.program_id(2) * steps

    def block(i, carry):
        j = first + i
        if page_size:  # slots_ref: the page table; the pool rows of positions j*BS ... from their pages
            kpos = j * block_s + jax.lax.broadcasted_iota(jnp.int32, (block_s,), 0)
            pages = slots_ref.shape[0]
            page = slots_ref[jnp.minimum(kpos // page_size, pages - 1)]
            rows = jnp.where(kpos < pages * page_size, page * page_size + kpos % page_size, -1)
        else:
            rows = slots_ref[pl.ds(j * block_s, block_s)]  # [BS] pool rows of positions j*BS ...
        valid_row = rows >= 0
        rows = jnp.maximum(rows, 0)
        # keys_major: [BS, N] products, so the sum over heads stays within a warp's lanes; else [N, BS]
        prod = lambda a, k: jax.lax.dot_general(  # noqa: E731
            *((k, a) if keys_major else (a, k)), _CONTRACT, precision=prec, preferred_element_type=jnp.float32
        )
        s = prod(q, _dequantized_rows(kv_ref, ks_ref, rows, cdt) if mx else kv_ref[rows, :].astype(cdt))
        if keys_major:
            score = jnp.sum(w[None, :] * jnp.maximum(s * scale, 0.0), axis=1)  # [BS]
        else:
            score = jnp.sum(w[:, None] * jnp.maximum(s * scale, 0.0), axis=0)
        pos = j * block_s + jax.lax.broadcasted_iota(jnp.int32, (block_s,), 0)
        ok = valid_row & (pos <= pos_ref[...]) & (pos < len_ref[...])
        score = jnp.where(ok, score, -jnp.inf)
        out_ref[pl.ds(i * block_s, block_s)] = score
        return finite_stats_step(carry, score) if stats else carry

    def masked(i, carry):
        out_ref[pl.ds(i * block_s, block_s)] = jnp.full((block_s,), -jnp.inf, jnp.float32)
        return carry

    # Blocks past the query's position (a causal prefill: half of them) or the sequence's length are not
    # gathered or scored, only written as -inf.
    last = jnp.minimum(pos_ref[0], len_ref[0] - 1)  # the last key position this query sees
    n_vis = jnp.clip(jnp.where(last < 0, 0, last // block_s + 1) - first, 0, steps)
    acc = jax.lax.fori_loop(0, n_vis, block, finite_stats_init(block_s, jnp.float32) if stats else 0)
    jax.lax.fori_loop(n_vis, steps, masked, 0)
    if stats:  # the split selection's first pass, from the scores still in registers
        stats_ref[...] = stats_row(acc)
        # and the row's visible prefix (every program of the query writes the same value): scores past it are -inf
        seen = slots_ref.shape[0] * (page_size or 1)  # key positions the slots or pages cover
        limit_ref[...] = jnp.full((1,), jnp.clip(jnp.minimum(pos_ref[0] + 1, len_ref[0]), 0, seen), jnp.int32)


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale", "block_s", "steps", "precision", "interpret", "num_warps", "num_stages", "stats", "keys_major",
        "page_size", "keys",
    ),
)  # fmt: skip
def indexer_scores_pallas(
    q, w, q_positions, kv_lengths, slots, kv_rows, kv_scales, *, scale, block_s, precision, interpret, steps=1,
    num_warps=4, num_stages=2, stats=False, keys_major=False, page_size=None, keys=None,
):  # fmt: skip
    """q [B, T, N, H] (N >= 16), w [B, T, N], q_positions [B, T], kv_lengths [B], slots [B, S] int32 pool row
    of each position (-1 = none; S a multiple of block_s * steps), kv_rows [rows, H] (dense, or E4M3 values
    with kv_scales [rows, H/32] uint8 E8M0 bits) -> scores [B, T, S] float32, -inf where masked. Each program
    scores `steps` consecutive blocks of block_s keys.
    page_size: `slots` is the page table [B, n] instead (pool row = page · page_size + offset, positions from
    n · page_size on none), and `keys` the S of the output: the kernel finds the rows itself, with no [B, S]
    slot array written before it.
    stats: also return the statistics `select_split.top_k_split(stats=...)` starts from, [B, T, P, STATS]:
    count, sum, sum of squares, min and max of the finite scores of each program's keys (P: the programs per
    query rounded up to a power of two; rows from S / (block_s * steps) on are left unwritten), and each
    query's visible prefix [B, T, 1] int32, min(position + 1, kv_length) within the slots (or pages): the
    split selection's limits.
    keys_major: the products as [keys, heads] tiles, so the weighted sum over heads stays within a warp's
    lanes (why: faster than [heads, keys] tiles; measurements in docs/performance.md#indexer)."""
    b, t, n, h = q.shape
    if (page_size is None) != (keys is None):
        raise ValueError(f"indexer_scores_pallas: page_size={page_size} and keys={keys} go together")
    s_len = slots.shape[1] if keys is None else keys
    span = block_s * steps
    if s_len % span:
        raise ValueError(f"indexer_scores_pallas: {s_len} key slots are not a multiple of block_s * steps = {span}")
    mx = kv_scales is not None
    params = triton_params(interpret, num_warps, num_stages)
    in_specs = [
        pl.BlockSpec((None, None, n, h), lambda i, tt, j: (i, tt, 0, 0)),
        pl.BlockSpec((None, None, n), lambda i, tt, j: (i, tt, 0)),
        pl.BlockSpec((None, None, 1), lambda i, tt, j: (i, tt, 0)),
        pl.BlockSpec((None, 1), lambda i, tt, j: (i, 0)),
        pl.BlockSpec((None, slots.shape[1]), lambda i, tt, j: (i, 0)),
    ]
    in_specs, args = _with_pool(
        in_specs, [q, w, q_positions[..., None], kv_lengths[:, None], slots], kv_rows, kv_scales
    )
    kernel = functools.partial(
        _kernel, scale=scale, block_s=block_s, steps=steps, mx=mx, precision=precision, stats=stats,
        keys_major=keys_major, page_size=page_size,
    )  # fmt: skip
    out_specs = [pl.BlockSpec((None, None, span), lambda i, tt, j: (i, tt, j))]
    out_shape = [jax.ShapeDtypeStruct((b, t, s_len), jnp.float32)]
    if stats:
        out_specs.append(pl.BlockSpec((None, None, None, STATS), lambda i, tt, j: (i, tt, j, 0)))
        out_shape.append(jax.ShapeDtypeStruct((b, t, pow2(s_len // span), STATS), jnp.float32))
        out_specs.append(pl.BlockSpec((None, None, 1), lambda i, tt, j: (i, tt, 0)))
        out_shape.append(jax.ShapeDtypeStruct((b, t, 1), jnp.int32))
    out = pl.pallas_call(
        kernel,
        grid=(b, t, s_len // span),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        name="indexer_scores",
        **params,
    )(*args)
    return tuple(out) if stats else out[0]


def _tile_kernel(
    q_ref, w_ref, pos_ref, len_ref, slots_ref, kv_ref, *rest, scale, block_k, heads, head_dim, mx, precision
):  # fmt: skip
    if mx:
        ks_ref, out_ref = rest
    else:
        (out_ref,) = rest
    prec, cdt = _products(precision)
    first_key = pl.program_id(2) * block_k
    pos = pos_ref[...]  # [BQ]
    kv_len = len_ref[0]
    seen = first_key <= jnp.minimum(jnp.max(pos), kv_len - 1)  # some query of the tile sees this key tile

    @pl.when(seen)
    def _():
        rows = slots_ref[...]  # [BK]
        valid = rows >= 0
        rows = jnp.maximum(rows, 0)
        if mx:  # dequantized once per tile (a power-of-two scale: exact in bfloat16), 32-wide pieces
            pieces = []
            for c in range(head_dim // MX_BLOCK):
                e = ks_ref[rows, c].astype(jnp.float32)
                vals = kv_ref[rows, pl.ds(c * MX_BLOCK, MX_BLOCK)].astype(jnp.float32)
                pieces.append((vals * jnp.exp2(e - 127.0)[:, None]).astype(cdt))
        else:
            k = kv_ref[rows, :].astype(cdt)  # [BK, H]

        def head(h, acc):
            if mx:
                s = None
                for c, kc in enumerate(pieces):
                    qc = q_ref[:, h, pl.ds(c * MX_BLOCK, MX_BLOCK)].astype(cdt)
                    part = jax.lax.dot_general(qc, kc, _CONTRACT, precision=prec, preferred_element_type=jnp.float32)
                    s = part if s is None else s + part
            else:
                qh = q_ref[:, h, :].astype(cdt)  # [BQ, H]
                s = jax.lax.dot_general(qh, k, _CONTRACT, precision=prec, preferred_element_type=jnp.float32)
            # w ReLU(scale s) = (w scale) ReLU(s) for scale > 0: a max and a fused multiply-add per score and
            # head, where the products leave the tensor cores (this epilogue runs once per head and tile)
            return acc + (w_ref[:, h].astype(jnp.float32) * scale)[:, None] * jnp.maximum(s, 0.0)

        acc = jax.lax.fori_loop(0, heads, head, jnp.zeros(out_ref.shape, jnp.float32))
        kpos = first_key + jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        ok = (valid & (kpos < kv_len))[None, :] & (kpos[None, :] <= pos[:, None])
        out_ref[...] = jnp.where(ok, acc, -jnp.inf)

    # key tiles past every query of the tile (half of a causal prefill) or past the length: not read
    @pl.when(jnp.logical_not(seen))
    def _():
        out_ref[...] = jnp.full(out_ref.shape, -jnp.inf, jnp.float32)


@functools.partial(
    jax.jit, static_argnames=("scale", "block_q", "block_k", "precision", "interpret", "num_warps", "num_stages")
)
def indexer_scores_tiled_pallas(
    q, w, q_positions, kv_lengths, slots, kv_rows, kv_scales, *, scale, block_q, block_k, precision, interpret,
    num_warps=4, num_stages=2,
):  # fmt: skip
    """The scores of `indexer_scores_pallas` for many queries (prefill): one program per (sequence, tile of
    block_q queries, tile of block_k keys), the key tile gathered once and multiplied by every head's
    [block_q, H] queries (a tensor-core product per head, ReLU-weighted into one [block_q, block_k] tile),
    so a key row is read once per query tile instead of once per query. T must be a multiple of block_q
    (padded queries: position -1), S of block_k."""
    b, t, n, h = q.shape
    s_len = slots.shape[1]
    if t % block_q or s_len % block_k:
        raise ValueError(
            f"indexer_scores_tiled_pallas: {t} queries / {s_len} keys are not multiples of {block_q} / {block_k}"
        )
    if not scale > 0:  # the kernel moves the scale out of the ReLU
        raise ValueError(f"indexer_scores_tiled_pallas: scale={scale} must be positive")
    mx = kv_scales is not None
    in_specs = [
        pl.BlockSpec((None, block_q, n, h), lambda i, a, j: (i, a, 0, 0)),
        pl.BlockSpec((None, block_q, n), lambda i, a, j: (i, a, 0)),
        pl.BlockSpec((None, block_q), lambda i, a, j: (i, a)),
        pl.BlockSpec((None, 1), lambda i, a, j: (i, 0)),
        pl.BlockSpec((None, block_k), lambda i, a, j: (i, j)),
    ]
    in_specs, args = _with_pool(in_specs, [q, w, q_positions, kv_lengths[:, None], slots], kv_rows, kv_scales)
    kernel = functools.partial(
        _tile_kernel, scale=scale, block_k=block_k, heads=n, head_dim=h, mx=mx, precision=precision
    )
    return pl.pallas_call(
        kernel,
        grid=(b, t // block_q, s_len // block_k),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, block_q, block_k), lambda i, a, j: (i, a, j)),
        out_shape=jax.ShapeDtypeStruct((b, t, s_len), jnp.float32),
        interpret=interpret,
        name="indexer_scores_tiled",
        **triton_params(interpret, num_warps, num_stages),
    )(*args)
