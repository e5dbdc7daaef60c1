"""RMSNorm with an optional residual add, as the model's layers compute it: the ground truth.

    h = x (+ residual, rounded to x's dtype);  y = w ⊙ cast(h · (mean(h²) + ε)^-1/2)
(statistics in float32; the weight applied after the cast to the compute dtype, as HF's Llama-style norms.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm_reference(x, weight, *, eps: float, residual=None, out_dtype=None):
    """x [..., D], weight [D] (, residual like x) -> (h, y): h = x + residual in x's dtype (x itself without
    one), y = the norm of h in out_dtype (default x's dtype)."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    h = x if residual is None else (residual + x).astype(x.dtype)
    h32 = h.astype(jnp.float32)
    y = h32 * jax.lax.rsqrt(jnp.mean(h32 * h32, axis=-1, keepdims=True) + eps)
    return h, weight.astype(out_dtype) * y.astype(out_dtype)
