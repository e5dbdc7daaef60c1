"""Pallas kernel: dense MLA decode (absorbed form) read straight from the paged latent / rope pools, split over
the context (flash-decoding).

The query rows of one sequence (T queries x N heads, flattened to M rows, each with its own position) are cut
into blocks of BH rows. One program per (head block, split, sequence). A sequence's visible keys are the
positions [0, limit[b]) (limit = min(kv_length, last query position + 1), read from memory); they are cut into
blocks of BK positions and the blocks shared out evenly over the S splits *at run time*, so every program has
work at any context length and nothing is walked past the sequence's end (a static split of the cache's whole
span would leave most programs idle at a short context and walk unused slots at a long one). Each program
looks its positions up in the page table, loads the rows `c` (and `k_rope`) from the pools (a page's rows are
contiguous, so the loads are whole rows), scores them for its BH rows, masks what a row's own position does not
see (verify steps: query t sees only positions <= its own), and folds them into a running max / sum / output.
It writes its part's normalised output and natural-log LSE; `api.mla_decode` merges the parts by LSE.

FP8 latent pool (E4M3 values, one float32 scale per `tile` values): each tile's scores and output terms are
scaled by the row's tile scale, as in the sparse-MLA FP8 kernel; the E4M3 values enter the tensor cores as
bfloat16 (exact).

Generic Pallas: Triton lowering on GPU, interpret mode on CPU (tests). Loaded tiles have power-of-two sizes:
L, R (0 = no rope part), BH and BK are powers of two.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._pallas import triton_params

CONTRACT_LAST = (((1,), (1,)), ((), ()))


def _kernel(*refs, scale, block_k, splits, page_size, n_pages, lat, rope, rope_off, tile, precision):
    if rope:
        lim_ref, table_ref, qpos_ref, ql_ref, qr_ref, lat_ref, *rest = refs
    else:
        lim_ref, table_ref, qpos_ref, ql_ref, lat_ref, *rest = refs
        qr_ref = None
    fp8 = tile < lat
    sc_ref = rest.pop(0) if fp8 else None
    rope_ref = rest.pop(0) if rope else None
    o_ref, lse_ref = rest
    prec = jax.lax.Precision.HIGHEST if precision == "ieee" else jax.lax.Precision.DEFAULT
    # "bf16": bfloat16 operands into the tensor cores and bfloat16 probabilities for the output product (as
    # flash attention does), float32 accumulation; else float32 operands (TF32 or full float32 products)
    op = jnp.bfloat16 if precision == "bf16" else jnp.float32
    split, seq = pl.program_id(1), pl.program_id(2)
    limit = lim_ref[seq]
    n_blocks = (limit + block_k - 1) // block_k
    per = (n_blocks + splits - 1) // splits
    lo = jnp.minimum(split * per, n_blocks)
    hi = jnp.minimum(lo + per, n_blocks)

    nt = lat // tile
    ql = [ql_ref[:, pl.ds(c * tile, tile)].astype(op) for c in range(nt)]  # [BH, tile] each
    qr = qr_ref[...].astype(op) if rope else None  # [BH, R]
    qpos = qpos_ref[...]  # [BH]; -1 for padded rows: they see nothing
    bh = ql[0].shape[0]
    lane = jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)

    def body(i, carry):
        m, l_sum, accs = carry
        pos = i * block_k + lane  # [BK]
        page = table_ref[seq * n_pages + jnp.minimum(pos // page_size, n_pages - 1)]
        rows = page * page_size + pos % page_size
        s = jnp.zeros((bh, block_k), jnp.float32)
        if rope:
            kr = rope_ref[rows, pl.ds(rope_off, rope)].astype(op)  # [BK, R]
            s = jax.lax.dot_general(qr, kr, CONTRACT_LAST, precision=prec, preferred_element_type=jnp.float32)
        vals, scales = [], []
        for c in range(nt):
            vals.append(lat_ref[rows, pl.ds(c * tile, tile)].astype(op))  # [BK, tile]
            part = jax.lax.dot_general(
                ql[c], vals[c], CONTRACT_LAST, precision=prec, preferred_element_type=jnp.float32
            )
            if fp8:
                scales.append(sc_ref[rows, c].astype(jnp.float32))  # [BK]
                part = part * scales[c][None, :]
            s = s + part
        visible = (pos[None, :] <= qpos[:, None]) & (pos < limit)[None, :]
        s = jnp.where(visible, s * scale, -jnp.inf)  # [BH, BK]
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing seen yet: keep exp() away from inf - inf
        p = jnp.exp(s - safe[:, None])
        alpha = jnp.exp(m - safe)
        l_sum = l_sum * alpha + jnp.sum(p, axis=1)
        accs = tuple(
            acc * alpha[:, None]
            + jnp.dot(
                (p * scales[c][None, :] if fp8 else p).astype(op), vals[c], precision=prec,
                preferred_element_type=jnp.float32,
            )
            for c, acc in enumerate(accs)
        )  # fmt: skip
        return m_new, l_sum, accs

    init = (
        jnp.full((bh,), -jnp.inf, jnp.float32),
        jnp.zeros((bh,), jnp.float32),
        tuple(jnp.zeros((bh, tile), jnp.float32) for _ in range(nt)),
    )
    m, l_sum, accs = jax.lax.fori_loop(lo, hi, body, init)  # bounds read from memory: one counted loop
    empty = l_sum == 0.0
    denom = jnp.where(empty, 1.0, l_sum)[:, None]
    for c, acc in enumerate(accs):
        o_ref[:, pl.ds(c * tile, tile)] = jnp.where(empty[:, None], 0.0, acc / denom).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l_sum)))


@functools.partial(
    jax.jit,
    static_argnames=("scale", "page_size", "block_h", "block_k", "splits", "precision", "interpret", "num_warps",
                     "num_stages"),
)  # fmt: skip
def mla_decode_pallas(
    q_latent, q_rope, q_positions, limits, page_table, lat_rows, lat_scales=None, rope_rows=None, *, scale,
    page_size, block_h, block_k, splits, precision, interpret, num_warps=4, num_stages=2,
):  # fmt: skip
    """q_latent [B, M, L], q_rope [B, M, R] (R = 0: no rope part), q_positions [B, M] int32 (-1: a padded row),
    limits [B] int32 (positions [0, limit) may be visible), page_table [B, n] int32, lat_rows [P·G, L] (or
    [P·G, L + R] holding the rope columns when rope_rows is None and R > 0), lat_scales [P·G, L / tile]
    float32 for E4M3 lat_rows, rope_rows [P·G, R]. M a multiple of block_h.
    -> (out [B, S, M, L] in q_latent.dtype, each split's softmax-normalised output; lse [B, S, M] float32)."""
    b, m, lat = q_latent.shape
    rope = q_rope.shape[-1]
    n_pages = page_table.shape[1]
    rope_off = 0
    if rope and rope_rows is None:  # one pool [c | k_rope]
        rope_rows, rope_off = lat_rows, lat
    tile = lat if lat_scales is None else lat // lat_scales.shape[1]
    kernel = functools.partial(
        _kernel, scale=scale, block_k=block_k, splits=splits, page_size=page_size, n_pages=n_pages, lat=lat,
        rope=rope, rope_off=rope_off, tile=tile, precision=precision,
    )  # fmt: skip
    whole = lambda x: pl.BlockSpec(x.shape, lambda h, j, i: (0,) * x.ndim)  # noqa: E731
    rows_of = lambda w: pl.BlockSpec((None, block_h, w), lambda h, j, i: (i, h, 0))  # noqa: E731
    specs = [whole(limits), whole(page_table.reshape(-1)), pl.BlockSpec((None, block_h), lambda h, j, i: (i, h))]
    args = [limits.astype(jnp.int32), page_table.reshape(-1).astype(jnp.int32), q_positions.astype(jnp.int32)]
    specs += [rows_of(lat)] + ([rows_of(rope)] if rope else [])
    args += [q_latent] + ([q_rope] if rope else [])
    specs.append(whole(lat_rows))
    args.append(lat_rows)
    if lat_scales is not None:
        specs.append(whole(lat_scales))
        args.append(lat_scales.astype(jnp.float32))
    if rope:
        specs.append(whole(rope_rows))
        args.append(rope_rows)
    # grid: head blocks fastest, so the head blocks of one (split, sequence) start together and share its rows
    # through L2
    return pl.pallas_call(
        kernel,
        grid=(m // block_h, splits, b),
        in_specs=specs,
        out_specs=[
            pl.BlockSpec((None, None, block_h, lat), lambda h, j, i: (i, j, h, 0)),
            pl.BlockSpec((None, None, block_h), lambda h, j, i: (i, j, h)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, splits, m, lat), q_latent.dtype),
            jax.ShapeDtypeStruct((b, splits, m), jnp.float32),
        ],
        interpret=interpret,
        name="mla_decode_fp8" if lat_scales is not None else "mla_decode",
        **triton_params(interpret, num_warps, num_stages),
    )(*args)
