"""FP8 formats: OCP MXFP8 (E4M3 elements, one E8M0 scale per 32) and the per-tile FP8 KV-cache format.

MXFP8 (OCP Microscaling v1.0; docs/architecture.md §9): for each block of 32 contiguous elements,
    e = floor(log2(max |x|)) - 8            (8 = emax of E4M3), clamped to [-127, 127]
    X = 2^e (stored as E8M0: the byte e + 127),  P_i = RNE(x_i / X) saturated to ±448 (E4M3)
An all-zero block gets e = -127 and zero elements. A block holding NaN or ±Inf gets the NaN scale (0xFF),
so every element of that block dequantises to NaN: the spec's meaning of a NaN scale, never a silent value.

FP8 KV cache (FlashMLA's V3.2 layout): per `tile` (128) contiguous elements of one token and
head, s = 2^ceil(log2(max(amax / 448, 1e-4))) stored as float32, values E4M3(x / s). The power-of-two scale
makes x / s exact, so the only rounding is the E4M3 cast. NaN / Inf in a tile propagate to NaN in it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

E4M3_MAX = 448.0
E4M3_EMAX = 8
MX_BLOCK = 32


def _blocks(x: jax.Array, axis: int, block: int, what: str) -> tuple[jax.Array, int]:
    axis = axis % x.ndim
    if x.shape[axis] % block:
        raise ValueError(f"{what}: axis {axis} has size {x.shape[axis]}, not a multiple of the block size {block}")
    x = jnp.moveaxis(x, axis, -1)
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block), axis


def _unblocks(x: jax.Array, axis: int) -> jax.Array:
    return jnp.moveaxis(x.reshape(*x.shape[:-2], -1), -1, axis)


def _floor_log2(a: jax.Array) -> jax.Array:
    """floor(log2 a) for finite a > 0, exactly (frexp: a = m 2^e with m in [0.5, 1))."""
    return jnp.frexp(a)[1] - 1


def _to_e4m3(x: jax.Array) -> jax.Array:
    # The float32 -> E4M3 cast does not saturate (465 -> NaN): clip first.
    return jnp.clip(x, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)


def quantize_mxfp8(x: jax.Array, axis: int = -1) -> tuple[jax.Array, jax.Array]:
    """x [..., n, ...] -> (values float8_e4m3fn, same shape; scales float8_e8m0fnu, n/32 along `axis`)."""
    xb, ax = _blocks(x.astype(jnp.float32), axis, MX_BLOCK, "quantize_mxfp8")
    amax = jnp.max(jnp.abs(xb), axis=-1)
    finite = jnp.isfinite(amax)
    e = jnp.where(amax > 0, _floor_log2(jnp.where(finite & (amax > 0), amax, 1.0)) - E4M3_EMAX, -127)
    e = jnp.clip(e, -127, 127)
    scale_bits = jnp.where(finite, e + 127, 255).astype(jnp.uint8)
    values = _to_e4m3(xb * jnp.ldexp(1.0, -e)[..., None])
    values = jnp.where(finite[..., None], values, jnp.asarray(jnp.nan, jnp.float8_e4m3fn))
    scales = jax.lax.bitcast_convert_type(scale_bits, jnp.float8_e8m0fnu)
    return _unblocks(values, ax), jnp.moveaxis(scales, -1, ax)


def dequantize_mxfp8(values: jax.Array, scales: jax.Array, axis: int = -1, dtype=jnp.float32) -> jax.Array:
    """Inverse of `quantize_mxfp8`: values * 2^(scale - 127), NaN where the scale is NaN."""
    vb, ax = _blocks(values.astype(jnp.float32), axis, MX_BLOCK, "dequantize_mxfp8")
    s = jnp.moveaxis(scales, ax, -1).astype(jnp.float32)  # E8M0 -> float32 is exact (0xFF -> NaN)
    return _unblocks(vb * s[..., None], ax).astype(dtype)


def quantize_kv_fp8(x: jax.Array, tile: int = 128) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (values float8_e4m3fn [..., D], scales float32 [..., D / tile]), power-of-two scales."""
    xb, _ = _blocks(x.astype(jnp.float32), -1, tile, "quantize_kv_fp8")
    amax = jnp.max(jnp.abs(xb), axis=-1)
    y = jnp.maximum(amax / E4M3_MAX, 1e-4)  # NaN stays NaN through maximum
    m, e = jnp.frexp(jnp.where(jnp.isfinite(y), y, 1.0))
    c = jnp.where(m == 0.5, e - 1, e)  # ceil(log2 y)
    s = jnp.where(jnp.isfinite(y), jnp.ldexp(1.0, c), jnp.nan)
    return _unblocks(_to_e4m3(xb / s[..., None]), -1), s


def dequantize_kv_fp8(values: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    tile = values.shape[-1] // scales.shape[-1]
    vb, _ = _blocks(values.astype(jnp.float32), -1, tile, "dequantize_kv_fp8")
    return _unblocks(vb * scales.astype(jnp.float32)[..., None], -1).astype(dtype)
