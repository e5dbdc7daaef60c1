"""Lightning indexer (DeepSeek-V3.2 DSA) scores and causal Top-K in float32 jnp: the ground truth.

    I[t, s] = sum_h w[t, h] * ReLU(scale * q[t, h] . k[s])      (docs/architecture.md §6)
Key s is a candidate for query t iff s <= q_positions[t] and s < kv_length. The K best candidates are
returned in descending score order; ties go to the lower position; missing candidates are -1.
Queries are processed in blocks so the [T, N, S] score tensor is never materialised whole.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._blocking import over_query_blocks, query_block_size
from pallas_kernels.paged import gather_pages

HIGHEST = jax.lax.Precision.HIGHEST


def indexer_scores(q, w, keys, *, scale):
    """q [B,T,N,H], w [B,T,N], keys [B,S,H] -> scores [B,T,S] float32 (no masking)."""
    s = jnp.einsum("btnh,bsh->btns", q.astype(jnp.float32), keys.astype(jnp.float32), precision=HIGHEST)
    return jnp.einsum("btns,btn->bts", jax.nn.relu(s * scale), w.astype(jnp.float32), precision=HIGHEST)


def indexer_topk_reference(q, w, k_pages, page_table, *, q_positions, kv_lengths, topk, scale):
    keys = gather_pages(k_pages, page_table)  # [B, S, H]
    b, t, n, _ = q.shape
    s = keys.shape[1]
    pos = jnp.arange(s)
    k_eff = min(topk, s)

    def block(qb, wb, qpos):
        scores = indexer_scores(qb, wb, keys, scale=scale)
        ok = (pos[None, None, :] <= qpos[:, :, None]) & (pos[None, None, :] < kv_lengths[:, None, None])
        vals, idx = jax.lax.top_k(jnp.where(ok, scores, -jnp.inf), k_eff)
        return jnp.where(jnp.isneginf(vals), -1, idx).astype(jnp.int32), vals

    idx, vals = over_query_blocks(block, query_block_size(t, b * n * s), q, w, q_positions)
    if k_eff < topk:  # more requested than the cache can ever hold
        extra = [(0, 0), (0, 0), (0, topk - k_eff)]
        idx = jnp.pad(idx, extra, constant_values=-1)
        vals = jnp.pad(vals, extra, constant_values=-jnp.inf)
    return idx, vals
