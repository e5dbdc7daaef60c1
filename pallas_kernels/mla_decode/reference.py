"""Dense MLA over a paged latent cache in the absorbed form (docs/architecture.md §5), float32 jnp: the ground
truth of `mla_decode`.

For query t of sequence b and head n, over the cached positions s visible to it (s <= q_positions[b, t] and
s < kv_lengths[b]):
    logit[n, s] = scale * (q_latent[n] . c_s + q_rope[n] . k_rope_s)
    out[n] = sum_s softmax(logit[n])_s c_s            (latent space; the caller applies W_UV)
    lse[n] = log sum_s exp(logit[n, s])
Each sequence's pages are gathered into one [B, S, L (+R)] copy first (the cost the kernel avoids).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._blocking import masked_softmax, over_query_blocks, query_block_size
from pallas_kernels.paged import dequantized, gather_pages

HIGHEST = jax.lax.Precision.HIGHEST


def mla_decode_reference(
    q_latent, q_rope, kv_pages, page_table, *, q_positions, kv_lengths, scale, rope_pages=None, latent_scales=None
):
    """q_latent [B,T,N,L], q_rope [B,T,N,R], kv_pages [P,G,L] (or [P,G,L+R] with the rope columns after the
    latent ones when rope_pages is None), rope_pages [P,G,R], latent_scales [P,G,L/tile] (an FP8 latent pool),
    page_table [B,n], q_positions [B,T], kv_lengths [B] -> (out [B,T,N,L] in q_latent.dtype, lse [B,T,N]
    float32; a query that sees nothing: out 0, lse -inf)."""
    b, t, n, lat = q_latent.shape
    ctx = gather_pages(kv_pages, page_table)  # [B,S,W]: only the sequences' own pages are read
    if latent_scales is not None:
        ctx = dequantized(ctx[..., :lat], gather_pages(latent_scales, page_table), jnp.float32)
    ctx = ctx.astype(jnp.float32)
    keys = ctx[..., :lat]
    if rope_pages is not None:
        k_rope = gather_pages(rope_pages, page_table).astype(jnp.float32)
    else:
        k_rope = ctx[..., lat:]
    s = ctx.shape[1]
    pos = jnp.arange(s)

    def block(ql, qr, qpos):
        logits = jnp.einsum("btnl,bsl->btns", ql.astype(jnp.float32), keys, precision=HIGHEST)
        if qr.shape[-1]:
            logits = logits + jnp.einsum("btnr,bsr->btns", qr.astype(jnp.float32), k_rope, precision=HIGHEST)
        visible = (pos[None, None, :] <= qpos[:, :, None]) & (pos[None, None, :] < kv_lengths[:, None, None])
        p, lse = masked_softmax(logits * scale, visible[:, :, None, :])
        out = jnp.einsum("btns,bsl->btnl", p, keys, precision=HIGHEST)
        return out.astype(q_latent.dtype), lse

    return over_query_blocks(block, query_block_size(t, b * n * s), q_latent, q_rope, q_positions)
