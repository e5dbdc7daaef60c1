"""Block Attention Residuals (docs/architecture.md §7): softmax attention over depth instead of a residual sum."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_jax.layers.common import DTypes, RMSNorm

# Rows (tokens) from which the mix streams its sources instead of stacking them: at prefill the stacked form's
# float32 copy of every source costs a pass over all of them; at decode XLA fuses the stacked form into fewer
# kernels (docs/performance.md#block-attnres).
STREAM_MIN_ROWS = 1024


class AttnResMix(nnx.Module):
    """h = Σ_i softmax_i(w · RMSNorm(v_i)) v_i over the sources v = [b_0, ..., b_{n-1}, partial].

    b_0 is the token embedding, b_j a completed block's summed sub-layer outputs, `partial` the running
    sum of the current block. `w` (pseudo_queries) is a learned, input-independent query; keys are
    RMS-normalised, values are not; no temperature. All in float32 (as the Kimi K3 reference keeps these modules).
    Random init uses N(0, 1/D) for w (not the paper's zero init) so that tests see non-uniform weights.
    """

    def __init__(self, dim: int, *, eps: float, rngs: nnx.Rngs):
        f32 = DTypes(compute=jnp.float32, param=jnp.float32)
        self.pseudo_queries = nnx.Linear(
            dim,
            1,
            use_bias=False,
            dtype=jnp.float32,
            param_dtype=jnp.float32,
            kernel_init=nnx.with_metadata(nnx.initializers.normal(dim**-0.5), logical_axes=("embed", None)),
            rngs=rngs,
        )
        self.attn_residual_norm = RMSNorm(dim, eps=eps, dt=f32)

    def __call__(self, blocks: list[jax.Array], partial: jax.Array) -> jax.Array:
        if math.prod(partial.shape[:-1]) >= STREAM_MIN_ROWS:
            return self._streamed(blocks, partial)
        src = jnp.stack([*blocks, partial.astype(jnp.float32)], axis=-2)  # [B,T,n+1,D]
        logits = self.pseudo_queries(self.attn_residual_norm(src))[..., 0]  # [B,T,n+1]
        p = jax.nn.softmax(logits, axis=-1)
        return jnp.einsum("btn,btnd->btd", p, src, precision=jax.lax.Precision.HIGHEST).astype(partial.dtype)

    def _streamed(self, blocks: list[jax.Array], partial: jax.Array) -> jax.Array:
        """The same mix without the stack: w · RMSNorm(v) = rsqrt(mean(v²) + eps) · (v · (g ⊙ w))."""
        f32 = jnp.float32
        u = self.pseudo_queries.kernel[...][:, 0].astype(f32) * self.attn_residual_norm.weight[...].astype(f32)
        eps = self.attn_residual_norm.eps
        src = [*blocks, partial]
        logits = []
        for v in src:
            v = v.astype(f32)
            inv = jax.lax.rsqrt(jnp.mean(v * v, axis=-1) + eps)
            logits.append(jnp.sum(v * u, axis=-1) * inv)
        p = jax.nn.softmax(jnp.stack(logits, axis=-1), axis=-1)  # [B,T,n+1]
        out = p[..., 0, None] * src[0].astype(f32)
        for i, v in enumerate(src[1:], start=1):
            out = out + p[..., i, None] * v.astype(f32)
        return out.astype(partial.dtype)
