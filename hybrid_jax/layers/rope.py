"""Rotary position embeddings with DeepSeek YaRN scaling (docs/architecture.md §5, §6).

MLA rotates adjacent pairs (2i, 2i+1) (DeepSeek's reference); the DSA indexer rotates half-split pairs
(i, i + R/2). Angles are built in float32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from hybrid_jax.config import YarnScaling, yarn_mscale


def inv_frequencies(dim: int, theta: float, scaling: YarnScaling | None) -> np.ndarray:
    """[dim/2] float32 inverse frequencies, with the YaRN interpolation ramp when `scaling` is set."""
    inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if scaling is None or scaling.factor <= 1.0:
        return inv_freq.astype(np.float32)

    def correction_dim(rotations: float) -> float:
        return (
            dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))
        )

    low = max(math.floor(correction_dim(scaling.beta_fast)), 0)
    high = min(math.ceil(correction_dim(scaling.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp, as the references do
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation = 1.0 - ramp  # 1 = keep the original frequency (high-frequency dims)
    inv_freq = inv_freq / scaling.factor * (1.0 - extrapolation) + inv_freq * extrapolation
    return inv_freq.astype(np.float32)


def attention_factor(scaling: YarnScaling | None) -> float:
    """YaRN's cos/sin magnitude factor, mscale(factor, mscale) / mscale(factor, mscale_all_dim) (HF)."""
    if scaling is None:
        return 1.0
    return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(scaling.factor, scaling.mscale_all_dim)


def _angles(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, R/2]
    return jnp.cos(ang), jnp.sin(ang)


def rope_tables(positions: jax.Array, inv_freq: np.ndarray, factor: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [B, T, R/2] float32 at integer positions [B, T], scaled by the attention factor."""
    cos, sin = _angles(positions, inv_freq)
    return cos * factor, sin * factor


def apply_rope(
    x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, *, interleaved: bool, factor: float = 1.0
) -> jax.Array:
    """Rotate x [B, T, (N,) R] at integer positions [B, T]."""
    cos, sin = rope_tables(positions, inv_freq, factor)
    if x.ndim == 4:  # per-head input: broadcast the tables over heads
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x32 = x.astype(jnp.float32)
    if interleaved:
        x1, x2 = x32[..., 0::2], x32[..., 1::2]
        y = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)
    else:
        half = x.shape[-1] // 2
        x1, x2 = x32[..., :half], x32[..., half:]
        y = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return y.astype(x.dtype)
