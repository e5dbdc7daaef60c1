"""jnp ground truth of the indexer's decode prolog (docs/architecture.md §6): everything the lightning indexer
computes from one step's inputs before it scores keys.

    q = RoPE(bf(c_q W_qb))               [M, N, H]   (RoPE, half-split, on the first R dims of each head)
    k = RoPE(bf(LayerNorm(bf(x W_k))))   [M, H]
    w = (x W_w) N^-1/2                   [M, N]      float32
bf(·) rounds to the compute dtype (x.dtype), as a "bf16 GEMM" does (float32 accumulation, bf16 output);
everything else is float32. cos / sin [M, R/2] are the RoPE tables with any attention factor applied.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def rope_half(x, cos, sin, rope_dim: int):
    """Half-split RoPE on the first rope_dim channels of x [..., H] (cos / sin broadcast to [..., R/2]); the
    rest pass through. Computed in float32, returned in x.dtype."""
    if rope_dim == 0:
        return x
    half = rope_dim // 2
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:rope_dim]
    rot = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)
    return jnp.concatenate([rot, x[..., rope_dim:]], axis=-1)


def indexer_prolog_reference(x, c_q, wq_b, wk, ln_w, ln_b, wp, cos, sin, *, num_heads: int, rope_dim: int, eps: float):
    """x [M, D], c_q [M, Q] (compute dtype); wq_b [Q, N·H], wk [D, H]; ln_w / ln_b [H]; wp [D, N] float32;
    cos / sin [M, R/2] float32 -> (q [M, N, H], k [M, H] in x.dtype, w [M, N] float32)."""
    dt = x.dtype
    m, h = x.shape[0], wk.shape[1]
    mm = lambda a, b: jnp.dot(a, b.astype(a.dtype), preferred_element_type=jnp.float32, precision=HIGHEST)  # noqa: E731
    q = mm(c_q, wq_b).astype(dt).reshape(m, num_heads, h)
    q = rope_half(q, cos[:, None], sin[:, None], rope_dim)
    k32 = mm(x, wk).astype(dt).astype(jnp.float32)
    mu = jnp.mean(k32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(k32 - mu), axis=-1, keepdims=True)
    k = ((k32 - mu) * jax.lax.rsqrt(var + eps) * ln_w + ln_b).astype(dt)
    k = rope_half(k, cos, sin, rope_dim)
    w = jnp.dot(x.astype(jnp.float32), wp.astype(jnp.float32), precision=HIGHEST) * num_heads**-0.5
    return q, k, w
