"""A bias-free projection y = x W with float32 accumulation: the ground truth."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def project_reference(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K], w [K, N] -> [..., N] float32 (products and sums in float32)."""
    return jnp.einsum("...k,kn->...n", x.astype(jnp.float32), w.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)  # fmt: skip
