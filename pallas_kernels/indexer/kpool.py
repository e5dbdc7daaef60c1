"""KPool indexer (GLM-5.3-Flash): indexer keys compressed per pool of P consecutive tokens.

Pool j holds the tokens at positions [jP, (j+1)P). Its key is a per-channel softmax-weighted mean of the
tokens' indexer keys, the weights from a learned gate projection plus a learned per-slot bias:

    key_j[c] = Σ_s softmax_s(g[jP+s, c] + ape[s, c]) k[jP+s, c]          (s over the pool's P slots)

A query at position t scores the complete pools only (those whose last token jP + P − 1 <= t) with the
lightning indexer's score, keeps the best `topk / P` and reads every token of them; when
`always_select_tail`, the tokens of its own incomplete pool, [⌊(t+1)/P⌋P, t], are read as well. Selected
pools are expanded back to token positions here (`expand_pools`); the pool scores go through
`indexer_topk` with pool positions: q' = ⌊(t+1)/P⌋ − 1, kv_length' = ⌊kv_length / P⌋.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import registry


def kpool_compress_reference(keys: jax.Array, gates: jax.Array, ape: jax.Array) -> jax.Array:
    """keys, gates [..., P, H], ape [P, H] -> pooled keys [..., H] float32."""
    logits = gates.astype(jnp.float32) + ape.astype(jnp.float32)
    p = jax.nn.softmax(logits, axis=-2)
    return jnp.sum(p * keys.astype(jnp.float32), axis=-2)


def kpool_compress(keys: jax.Array, gates: jax.Array, ape: jax.Array, *, impl: str = "auto") -> jax.Array:
    """Pooled indexer keys: keys, gates [..., P, H] (the pool's tokens in slot order), ape [P, H] ->
    [..., H] float32. One softmax-weighted sum per pool and channel; XLA fuses it (no kernel)."""
    if keys.shape != gates.shape or keys.shape[-2:] != ape.shape:
        raise ValueError(f"kpool_compress: keys {keys.shape}, gates {gates.shape}, ape {ape.shape} disagree")
    registry.resolve("kpool", impl)
    return kpool_compress_reference(keys, gates, ape)


def pool_query_positions(q_positions: jax.Array, pool: int) -> jax.Array:
    """The last complete pool a query at position t may read: ⌊(t+1)/P⌋ − 1 (−1: none yet)."""
    return (q_positions + 1) // pool - 1


def expand_pools(pool_idx: jax.Array, q_positions: jax.Array, pool: int, *, tail: bool) -> jax.Array:
    """Selected pools [B,T,k] (−1 = none) -> token positions [B,T,k·P (+ P−1 with the tail)] int32, −1 = none:
    each pool's P tokens, then (tail) the query's own incomplete pool [⌊(t+1)/P⌋P, t] padded with −1."""
    slots = jnp.arange(pool, dtype=jnp.int32)
    tokens = jnp.where(pool_idx[..., None] >= 0, pool_idx[..., None] * pool + slots, -1)
    tokens = tokens.reshape(*pool_idx.shape[:-1], -1)
    if not tail or pool == 1:
        return tokens.astype(jnp.int32)
    start = (q_positions + 1) // pool * pool
    count = (q_positions + 1) % pool
    rest = jnp.where(slots[:-1] < count[..., None], start[..., None] + slots[:-1], -1)
    return jnp.concatenate([tokens, rest], axis=-1).astype(jnp.int32)
