"""Dense causal attention with grouped heads, float32 softmax (the ground truth)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._blocking import masked_softmax, over_query_blocks, query_block_size

HIGHEST = jax.lax.Precision.HIGHEST


def attention_reference(q, k, v, *, q_positions, kv_lengths, scale):
    """q [B,T,N,H], k [B,S,K,H], v [B,S,K,Hv]; key s is visible to query t iff s <= q_positions[b,t] and
    s < kv_lengths[b]. Returns out [B,T,N,Hv] (q.dtype) and the natural-log LSE [B,T,N] (float32).
    Queries that see no key get out = 0 and lse = -inf."""
    b, t, n, h = q.shape
    s, nk = k.shape[1], k.shape[2]
    if n % nk:
        raise ValueError(f"query heads {n} not a multiple of kv heads {nk}")
    k32, v32 = k.astype(jnp.float32), v.astype(jnp.float32)
    pos = jnp.arange(s)

    def block(qb, qpos):
        tb = qb.shape[1]
        qg = qb.astype(jnp.float32).reshape(b, tb, nk, n // nk, h)
        logits = jnp.einsum("btkgh,bskh->btkgs", qg, k32, precision=HIGHEST) * scale
        visible = (pos[None, None, :] <= qpos[:, :, None]) & (pos[None, None, :] < kv_lengths[:, None, None])
        p, lse = masked_softmax(logits, visible[:, :, None, None, :])
        out = jnp.einsum("btkgs,bskv->btkgv", p, v32, precision=HIGHEST)
        return out.reshape(b, tb, n, v.shape[-1]).astype(q.dtype), lse.reshape(b, tb, n)

    return over_query_blocks(block, query_block_size(t, b * n * s), q, q_positions)
