"""Pallas kernel: RMSNorm (+ the residual add before it) of a few rows in one launch.

One program per row reads the row (and the residual row) once, sums the squares over D in power-of-two
slabs, and writes the sum and the normalised row. Why: at a batch-1 decode step XLA runs each norm as two
kernels (the sum of squares as a reduction, then the scaling) after the kernel that forms the residual sum
(the kernel is opt-in all the same: XLA's fused norm measured faster); measurements in
docs/performance.md#rmsnorm.

Generic Pallas: Triton lowering on GPU, interpret mode on CPU (tests). D must split into power-of-two slabs
of at least 16 (`slab`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._pallas import triton_params


def slab(d: int) -> int | None:
    """The largest power of two <= 1024 dividing d, at least 16; None if there is none."""
    s = 1024
    while s >= 16 and d % s:
        s //= 2
    return s if s >= 16 else None


def _kernel(*refs, eps, bs, residual, out_dtype):
    if residual:
        x_ref, r_ref, w_ref, h_ref, y_ref = refs
    else:
        x_ref, w_ref, y_ref = refs
    d = x_ref.shape[0]
    parts = []
    total = jnp.zeros((), jnp.float32)
    for i in range(d // bs):
        cols = pl.ds(i * bs, bs)
        h = x_ref[cols]
        if residual:
            h = (r_ref[cols].astype(jnp.float32) + h.astype(jnp.float32)).astype(x_ref.dtype)
            h_ref[cols] = h
        h32 = h.astype(jnp.float32)
        parts.append(h32)
        total += jnp.sum(h32 * h32)
    inv = jax.lax.rsqrt(total / d + eps)
    for i, h32 in enumerate(parts):
        cols = pl.ds(i * bs, bs)
        y_ref[cols] = w_ref[cols].astype(out_dtype) * (h32 * inv).astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("eps", "out_dtype", "interpret"))
def rms_norm_pallas(x, weight, residual=None, *, eps, out_dtype, interpret=False):
    """x [R, D] (, residual [R, D]), weight [D] -> (h [R, D] in x's dtype, y [R, D] in out_dtype); one
    program per row."""
    r, d = x.shape
    row = pl.BlockSpec((None, d), lambda i: (i, 0))
    has_res = residual is not None
    out_dtype = jnp.dtype(out_dtype)
    kernel = functools.partial(_kernel, eps=eps, bs=slab(d), residual=has_res, out_dtype=out_dtype)
    outs = pl.pallas_call(
        kernel,
        grid=(r,),
        in_specs=[row] + [row] * has_res + [pl.BlockSpec((d,), lambda i: (0,))],
        out_specs=[row] * has_res + [row],
        out_shape=[jax.ShapeDtypeStruct((r, d), x.dtype)] * has_res + [jax.ShapeDtypeStruct((r, d), out_dtype)],
        interpret=interpret,
        name="rms_norm",
        **triton_params(interpret, 4, 1),
    )(x, *([residual] if has_res else []), weight)
    return (outs[0], outs[1]) if has_res else (x, outs[0])
