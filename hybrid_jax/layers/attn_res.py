"""Block Attention Residuals (ARCH_SPEC §5.2-5.3): softmax attention over depth instead of a residual sum."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_jax.layers.common import DTypes, RMSNorm


class AttnResMix(nnx.Module):
    """h = Σ_i softmax_i(w · RMSNorm(v_i)) v_i over the sources v = [b_0, ..., b_{n-1}, partial].

    b_0 is the token embedding, b_j a completed block's summed sub-layer outputs, `partial` the running
    sum of the current block. `w` (pseudo_queries) is a learned, input-independent query; keys are
    RMS-normalised, values are not; no temperature. All in float32 (HF-K3 keeps these modules float32).
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
        src = jnp.stack([*blocks, partial.astype(jnp.float32)], axis=-2)  # [B,T,n+1,D]
        logits = self.pseudo_queries(self.attn_residual_norm(src))[..., 0]  # [B,T,n+1]
        p = jax.nn.softmax(logits, axis=-1)
        return jnp.einsum("btn,btnd->btd", p, src, precision=jax.lax.Precision.HIGHEST).astype(partial.dtype)
