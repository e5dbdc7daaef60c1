"""Mixture of experts with DeepSeek-V3 "noaux_tc" routing and shared experts (docs/architecture.md §8)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_jax import inspect
from hybrid_jax.config import HybridConfig
from hybrid_jax.layers.common import DTypes, Projection, SwiGLU, default_init, linear
from pallas_kernels import pallas_call_allowed
from pallas_kernels.moe import moe_experts, moe_route, route_reference


def route(logits: jax.Array, bias: jax.Array, cfg: HybridConfig) -> tuple[jax.Array, jax.Array]:
    """Router logits [N,E] float32 -> (combine weights [N,k] float32, expert ids [N,k] int32) under cfg's
    routing (`pallas_kernels.moe.reference.route_reference`: σ or softmax scores, selection on score + bias
    within the best `topk_group` of `n_group` groups, weights renormalised and scaled)."""
    return route_reference(logits, bias, **_routing(cfg))


def _routing(cfg: HybridConfig) -> dict:
    return dict(
        k=cfg.num_experts_per_tok, n_group=cfg.n_group, topk_group=cfg.topk_group, scoring=cfg.scoring_func,
        norm_topk_prob=cfg.norm_topk_prob, scaling=cfg.routed_scaling_factor,
    )  # fmt: skip


class Router(nnx.Module):
    def __init__(self, cfg: HybridConfig, dt: DTypes, rngs: nnx.Rngs):
        self.kernel = nnx.Param(
            default_init(rngs.params(), (cfg.hidden_size, cfg.num_experts), dt.param), logical_axes=("embed", None)
        )
        # Selection-only bias, float32 in every reference (DeepSeek's noaux_tc); none for a plain Top-K router
        if cfg.router_bias:
            self.e_score_correction_bias = nnx.Param(
                jax.random.uniform(rngs.params(), (cfg.num_experts,), jnp.float32, -0.05, 0.05), logical_axes=(None,)
            )
        self.num_experts = cfg.num_experts

    def bias(self) -> jax.Array:
        if hasattr(self, "e_score_correction_bias"):
            return self.e_score_correction_bias[...]
        return jnp.zeros((self.num_experts,), jnp.float32)


class Experts(nnx.Module):
    def __init__(self, cfg: HybridConfig, dt: DTypes, rngs: nnx.Rngs):
        e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        in_axes, out_axes = ("expert", "embed", "expert_mlp"), ("expert", "expert_mlp", "embed")
        self.gate_proj = nnx.Param(default_init(rngs.params(), (e, d, f), dt.param), logical_axes=in_axes)
        self.up_proj = nnx.Param(default_init(rngs.params(), (e, d, f), dt.param), logical_axes=in_axes)
        self.down_proj = nnx.Param(default_init(rngs.params(), (e, f, d), dt.param), logical_axes=out_axes)


class MoE(nnx.Module):
    """y = Σ_{e ∈ TopK(x)} w_e(x) E_e(x) + s(x) Shared(x); the sum is accumulated in float32 and cast once.
    s(x) = 1, or σ(W_sg x) per token with `shared_expert_gate` (Qwen3-Next)."""

    def __init__(self, cfg: HybridConfig, dt: DTypes, *, rngs: nnx.Rngs):
        self.cfg, self.dt = cfg, dt
        self.gate = Router(cfg, dt, rngs)
        self.experts = Experts(cfg, dt, rngs)
        if cfg.num_shared_experts:
            self.shared_experts = SwiGLU(cfg.hidden_size, cfg.shared_expert_width, dt, rngs, limit=cfg.swiglu_limit)
        if cfg.shared_expert_gate:
            self.shared_expert_gate = linear(cfg.hidden_size, 1, ("embed", None), dt, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:  # [B,T,D] -> [B,T,D]
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        # float32 logits (HF); at decode one router kernel does logits, top-k and weights (pallas_kernels/moe)
        w, idx = moe_route(x2, self.gate.kernel[...], self.gate.bias(), **_routing(self.cfg))
        inspect.add_route(indices=idx, weights=w)  # hybrid_jax.inspect.record_router(): read at trace time
        shared = self._shared_weights()
        ex = self.experts
        y = moe_experts(  # routed experts as grouped matmuls (pallas_kernels/moe), the shared one with them
            x2, idx, w, ex.gate_proj[...], ex.up_proj[...], ex.down_proj[...], shared=shared,
            swiglu_limit=self.cfg.swiglu_limit,
        )  # fmt: skip
        if self.cfg.num_shared_experts and shared is None:
            s = self.shared_experts(x2)
            if self.cfg.shared_expert_gate:
                s = jax.nn.sigmoid(self.shared_expert_gate(x2).astype(jnp.float32)) * s.astype(jnp.float32)
            y = y + s.astype(jnp.float32)
        return y.astype(self.dt.compute).reshape(shape)

    def _shared_weights(self):
        """The shared expert's (gate, up, down) kernels for `moe_experts` to run beside the routed ones (at a
        batch-1 decode step in the same two launches), or None where it stays a separate SwiGLU: quantized or
        biased projections, or a multi-device mesh (XLA partitions the SwiGLU's products by their logical
        axes; a Pallas call it cannot partition)."""
        if not self.cfg.num_shared_experts or self.cfg.shared_expert_gate or not pallas_call_allowed():
            return None
        layers = (self.shared_experts.gate_proj, self.shared_experts.up_proj, self.shared_experts.down_proj)
        if not all(isinstance(p, Projection) and p.bias is None for p in layers):
            return None
        return tuple(p.kernel[...].astype(p.dtype or p.kernel[...].dtype) for p in layers)
