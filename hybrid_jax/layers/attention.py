"""Gated grouped-query attention with a paged K/V cache (Qwen3-Next's full attention; docs/architecture.md §5b)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_jax.cache import AttnState, Pool, StepInfo, store_rows
from hybrid_jax.config import HybridConfig
from hybrid_jax.layers.common import DTypes, RMSNorm, linear, project_many
from hybrid_jax.layers.rope import apply_rope, inv_frequencies
from hybrid_jax.quant.config import QuantConfig
from pallas_kernels.attention import attention


class GatedAttention(nnx.Module):
    """Causal GQA with per-head q / k RMSNorm, partial RoPE and a sigmoid output gate.

        [q_n | g_n] = (W_q x)_n                 (per query head n: H values, then H gate values)
        k_j, v_j = (W_k x)_j, (W_v x)_j          (per key/value head j)
        q_n, k_j ← RMSNorm(q_n), RMSNorm(k_j)    (over H; zero-centred weights with `norm_zero_centered`)
        q, k ← RoPE on their first R dims        (half-split pairs (i, i + R/2), rope_theta, no scaling)
        o_n = softmax(q_n k_{j(n)}ᵀ / sqrt(H) + causal mask) v_{j(n)},   j(n) = n // (N / N_kv)
        y = W_o concat_n(o_n ⊙ σ(g_n))
    Only k and v (after norm and RoPE) are cached: `AttnState`, two pools of [P, G, N_kv·H] rows, stored dense
    or FP8 with one scale per `tile` values of a token (`QuantConfig.kv_cache`). Every mode reads the rows of
    each sequence's pages and runs the causal (G)QA op over them (`pallas_kernels.attention`).
    """

    def __init__(self, cfg: HybridConfig, dt: DTypes, quant: QuantConfig, *, rngs: nnx.Rngs):
        self.cfg, self.dt = cfg, dt
        self.fmt = "fp8" if quant.kv_cache.enabled else "dense"
        self.tile = quant.kv_cache.tile_size
        d, n, nkv, h = cfg.hidden_size, cfg.num_heads, cfg.attn_num_kv_heads, cfg.attn_head_dim
        self.q_proj = linear(d, n * h * (2 if cfg.attn_output_gate else 1), ("embed", "heads"), dt, rngs)
        self.k_proj = linear(d, nkv * h, ("embed", "kv_heads"), dt, rngs)
        self.v_proj = linear(d, nkv * h, ("embed", "kv_heads"), dt, rngs)
        self.o_proj = linear(n * h, d, ("heads", "embed"), dt, rngs)
        if cfg.attn_qk_norm:
            norm = dict(eps=cfg.rms_norm_eps, dt=dt, zero_centered=cfg.norm_zero_centered)
            self.q_norm = RMSNorm(h, **norm)
            self.k_norm = RMSNorm(h, **norm)

    def init_state(self, num_pages: int, page_size: int, dtype, batch_size: int) -> AttnState:
        del batch_size  # nothing per sequence: both pools are paged
        width = self.cfg.attn_num_kv_heads * self.cfg.attn_head_dim
        return AttnState(
            k=Pool.empty(num_pages, page_size, width, dtype, self.fmt, self.tile),
            v=Pool.empty(num_pages, page_size, width, dtype, self.fmt, self.tile),
        )

    def _rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        r = self.cfg.attn_rope_dim
        if r == 0:
            return x
        inv = inv_frequencies(r, self.cfg.rope_theta, None)
        return jnp.concatenate([apply_rope(x[..., :r], positions, inv, interleaved=False), x[..., r:]], axis=-1)

    def __call__(self, x: jax.Array, info: StepInfo, state: AttnState | None):
        """x [B,T,D] -> (y [B,T,D], the new state or None without a cache)."""
        cfg = self.cfg
        b, t, _ = x.shape
        n, nkv, h = cfg.num_heads, cfg.attn_num_kv_heads, cfg.attn_head_dim
        q, k, v = project_many([(self.q_proj, x), (self.k_proj, x), (self.v_proj, x)])
        q = q.reshape(b, t, n, -1)
        gate = q[..., h:] if cfg.attn_output_gate else None
        q, k = q[..., :h], k.reshape(b, t, nkv, h)
        if cfg.attn_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rope(q, info.positions), self._rope(k, info.positions)
        k_pool = store_rows(None if state is None else state.k, k.reshape(b, t, nkv * h), info, self.fmt, self.tile)
        v_pool = store_rows(None if state is None else state.v, v, info, self.fmt, self.tile)
        s = int(info.page_table.shape[1]) * k_pool.values.shape[1]
        keys, values = (p.gather(info.page_table, self.dt.compute).reshape(b, s, nkv, h) for p in (k_pool, v_pool))
        o, _ = attention(
            q, keys, values, q_positions=info.positions, kv_lengths=info.kv_lengths, scale=h**-0.5
        )  # [B,T,N,H]
        if gate is not None:
            o = (o.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(self.dt.compute)
        y = self.o_proj(o.reshape(b, t, n * h).astype(self.dt.compute))
        return y, None if state is None else AttnState(k=k_pool, v=v_pool)
