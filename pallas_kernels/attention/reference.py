"""Dense causal attention with grouped heads, float32 softmax (the ground truth)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def attention_reference(q, k, v, *, q_positions, kv_lengths, scale):
    """q [B,T,N,H], k [B,S,K,H], v [B,S,K,Hv]; key s is visible to query t iff s <= q_positions[b,t] and
    s < kv_lengths[b]. Returns out [B,T,N,Hv] (q.dtype) and the natural-log LSE [B,T,N] (float32).
    Queries that see no key get out = 0 and lse = -inf."""
    b, t, n, h = q.shape
    s, nk = k.shape[1], k.shape[2]
    if n % nk:
        raise ValueError(f"query heads {n} not a multiple of kv heads {nk}")
    qg = q.astype(jnp.float32).reshape(b, t, nk, n // nk, h)
    logits = jnp.einsum("btkgh,bskh->btkgs", qg, k.astype(jnp.float32), precision=HIGHEST) * scale
    pos = jnp.arange(s)
    visible = (pos[None, None, :] <= q_positions[:, :, None]) & (pos[None, None, :] < kv_lengths[:, None, None])
    logits = jnp.where(visible[:, :, None, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(logits - m_safe)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("btkgs,bskv->btkgv", p, v.astype(jnp.float32), precision=HIGHEST)
    lse = (jnp.log(denom) + m_safe)[..., 0]
    return out.reshape(b, t, n, v.shape[-1]).astype(q.dtype), lse.reshape(b, t, n)
