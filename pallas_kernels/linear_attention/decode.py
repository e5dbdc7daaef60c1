"""Pallas kernel: one KDA decode step for a batch of sequences, state updated in place.

Per (sequence b, head n, tile of V columns), with the state tile S [K, BV] in float32:
    q, k ← L2-normalised (eps 1e-6 inside the root), q ← q · scale
    S ← Diag(exp g) S;   u = β (v − Sᵀk);   S ← S + k uᵀ;   o = Sᵀq
Columns of S evolve independently (the delta rule mixes rows only), so tiles of V are independent programs
and each state byte is read once and written once: the floor of the step is 2 · B·N·K·V·4 bytes over the
memory bandwidth. The state output aliases the state input (`input_output_aliases`), so under jit with a
donated (or loop-carried) state no second state buffer is allocated.

Written against the generic Pallas API: it runs through the Triton lowering on GPU and in interpret mode
on CPU (the tests). Block dimensions must be powers of two for Triton; `kda_decode_step` pads K and V to
the next power of two when needed (zero rows/columns leave the update unchanged).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._pallas import triton_params


def _kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, o_ref, s_out_ref, *, scale: float, l2norm: bool):
    q = q_ref[...].astype(jnp.float32)  # [K]
    k = k_ref[...].astype(jnp.float32)  # [K]
    if l2norm:
        q = q * jax.lax.rsqrt(jnp.sum(q * q) + 1e-6)
        k = k * jax.lax.rsqrt(jnp.sum(k * k) + 1e-6)
    q = q * scale
    s = s_ref[...] * jnp.exp(g_ref[...].astype(jnp.float32))[:, None]  # [K, BV]
    ks = jnp.sum(k[:, None] * s, axis=0)  # [BV]
    u = beta_ref[...].astype(jnp.float32) * (v_ref[...].astype(jnp.float32) - ks)  # [BV] (beta [1] broadcasts)
    s = s + k[:, None] * u[None, :]
    s_out_ref[...] = s
    o_ref[...] = jnp.sum(q[:, None] * s, axis=0).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "l2norm", "block_v", "interpret", "num_warps"))
def decode_step_pallas(q, k, v, g, beta, state, *, scale, l2norm, block_v, interpret, num_warps=4):
    """q, k, g [B, N, K]; v [B, N, V]; beta [B, N]; state [B, N, K, V] float32 (K, V, block_v powers of two)
    -> (o [B, N, V] in q.dtype, new state)."""
    b, n, dk = q.shape
    dv = v.shape[-1]
    grid = (b, n, dv // block_v)
    vec_k = pl.BlockSpec((None, None, dk), lambda i, h, j: (i, h, 0))
    vec_v = pl.BlockSpec((None, None, block_v), lambda i, h, j: (i, h, j))
    state_spec = pl.BlockSpec((None, None, dk, block_v), lambda i, h, j: (i, h, 0, j))
    params = triton_params(interpret, num_warps, 1)
    return pl.pallas_call(
        functools.partial(_kernel, scale=scale, l2norm=l2norm),
        grid=grid,
        in_specs=[vec_k, vec_k, vec_v, vec_k, pl.BlockSpec((None, None, 1), lambda i, h, j: (i, h, 0)), state_spec],
        out_specs=[vec_v, state_spec],
        out_shape=[jax.ShapeDtypeStruct((b, n, dv), q.dtype), jax.ShapeDtypeStruct(state.shape, jnp.float32)],
        input_output_aliases={5: 1},
        interpret=interpret,
        name="kda_decode_step",
        **params,
    )(q, k, v, g, beta[..., None], state)
