"""Mixture of experts with DeepSeek-V3 "noaux_tc" routing and shared experts (ARCH_SPEC §6)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_jax.config import HybridConfig
from hybrid_jax.layers.common import DTypes, SwiGLU, _normal
from pallas_kernels.moe import moe_experts


def route(logits: jax.Array, bias: jax.Array, cfg: HybridConfig) -> tuple[jax.Array, jax.Array]:
    """Router logits [N,E] float32 -> (combine weights [N,k] float32, expert ids [N,k] int32).

    s = σ(logits) (or softmax); selection uses s + bias, restricted to the `topk_group` groups whose top-2
    biased scores sum highest; weights are the unbiased s of the chosen experts, renormalised
    (+1e-20, as HF) and multiplied by `routed_scaling_factor`.
    """
    s = jax.nn.sigmoid(logits) if cfg.scoring_func == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    choice = s + bias
    if cfg.n_group > 1:
        n, e = choice.shape
        grouped = choice.reshape(n, cfg.n_group, e // cfg.n_group)
        group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [N, G]
        _, keep = jax.lax.top_k(group_score, cfg.topk_group)
        keep_mask = jnp.any(jax.nn.one_hot(keep, cfg.n_group, dtype=jnp.bool_), axis=1)  # [N, G]
        choice = jnp.where(jnp.repeat(keep_mask, e // cfg.n_group, axis=1), choice, -jnp.inf)
    _, idx = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    w = jnp.take_along_axis(s, idx, axis=1)
    if cfg.norm_topk_prob:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return w * cfg.routed_scaling_factor, idx.astype(jnp.int32)


class Router(nnx.Module):
    def __init__(self, cfg: HybridConfig, dt: DTypes, rngs: nnx.Rngs):
        self.kernel = nnx.Param(
            _normal(rngs.params(), (cfg.hidden_size, cfg.num_experts), dt.param), logical_axes=("embed", None)
        )
        # Selection-only bias, float32 in every reference.
        self.e_score_correction_bias = nnx.Param(
            jax.random.uniform(rngs.params(), (cfg.num_experts,), jnp.float32, -0.05, 0.05), logical_axes=(None,)
        )


class Experts(nnx.Module):
    def __init__(self, cfg: HybridConfig, dt: DTypes, rngs: nnx.Rngs):
        e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        in_axes, out_axes = ("expert", "embed", "expert_mlp"), ("expert", "expert_mlp", "embed")
        self.gate_proj = nnx.Param(_normal(rngs.params(), (e, d, f), dt.param), logical_axes=in_axes)
        self.up_proj = nnx.Param(_normal(rngs.params(), (e, d, f), dt.param), logical_axes=in_axes)
        self.down_proj = nnx.Param(_normal(rngs.params(), (e, f, d), dt.param), logical_axes=out_axes)


class MoE(nnx.Module):
    """y = Σ_{e ∈ TopK(x)} w_e(x) E_e(x) + Shared(x); the sum is accumulated in float32 and cast once."""

    def __init__(self, cfg: HybridConfig, dt: DTypes, *, rngs: nnx.Rngs):
        self.cfg, self.dt = cfg, dt
        self.gate = Router(cfg, dt, rngs)
        self.experts = Experts(cfg, dt, rngs)
        if cfg.num_shared_experts:
            self.shared_experts = SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size * cfg.num_shared_experts, dt, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:  # [B,T,D] -> [B,T,D]
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        logits = jnp.dot(
            x2.astype(jnp.float32), self.gate.kernel[...].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
        )
        w, idx = route(logits, self.gate.e_score_correction_bias[...], self.cfg)
        y = moe_experts(  # routed experts as grouped matmuls (pallas_kernels/moe)
            x2, idx, w, self.experts.gate_proj[...], self.experts.up_proj[...], self.experts.down_proj[...]
        )
        if self.cfg.num_shared_experts:
            y = y + self.shared_experts(x2).astype(jnp.float32)
        return y.astype(self.dt.compute).reshape(shape)
