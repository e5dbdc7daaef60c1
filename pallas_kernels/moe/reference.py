"""Routed experts of an MoE layer, float32-accumulating jnp: the ground truth.

y_t = Σ_j w_tj E_{idx_tj}(x_t),   E(x) = W_down (SiLU(W_gate x) ⊙ W_up x)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sort_by_expert(idx: jax.Array, num_experts: int):
    """Token-expert pairs grouped by expert: (order [N*k] pair ids sorted by expert, stable; sizes [E])."""
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    return order, jnp.bincount(flat, length=num_experts).astype(jnp.int32)


def moe_experts_reference(x, idx, w, gate_proj, up_proj, down_proj):
    """x [N,D], idx/w [N,k], gate/up [E,D,F], down [E,F,D] -> [N,D] float32. The pairs run as grouped
    matmuls (`lax.ragged_dot`); exact whatever XLA lowers them to."""
    n, k = idx.shape
    order, sizes = sort_by_expert(idx, gate_proj.shape[0])
    token = order // k
    xs = x[token]  # [N*k, D], grouped by expert
    h_gate = jax.lax.ragged_dot(xs, gate_proj.astype(x.dtype), sizes, preferred_element_type=jnp.float32)
    h_up = jax.lax.ragged_dot(xs, up_proj.astype(x.dtype), sizes, preferred_element_type=jnp.float32)
    h = (jax.nn.silu(h_gate) * h_up).astype(x.dtype)
    y = jax.lax.ragged_dot(h, down_proj.astype(x.dtype), sizes, preferred_element_type=jnp.float32)
    y = y * w.reshape(-1)[order][:, None].astype(jnp.float32)
    return jnp.zeros((n, x.shape[1]), jnp.float32).at[token].add(y)
