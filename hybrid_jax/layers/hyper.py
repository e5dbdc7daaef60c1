"""Multi-stream hyper-connections (mHC, GLM-5.3-Flash; docs/architecture.md §7).

The residual stream is widened to N = `hc_mult` streams h [B, T, N, D]. Around every mixer and every FFN one
`HyperConnection` reads the N streams and produces, per token, three sets of weights:

    x̂ = RMSNorm_unweighted(concat_n h_n)                                  (over N·D values, eps = rms_norm_eps)
    [a_pre | a_post | a_comb] = W x̂                                       (W: [N·D, 2N + N²], float32)
    pre  = σ(s_0 a_pre + b_pre) + ε                                        [N]
    post = 2 σ(s_1 a_post + b_post)                                        [N]
    M    = Sinkhorn(softmax_row(s_2 a_comb + b_comb) + ε)                  [N, N]   (doubly stochastic)
    block input  u = Σ_n pre_n h_n
    new streams  h'_i = post_i · Block(u) + Σ_j M_ji h_j

Sinkhorn (`hc_sinkhorn_iters` = I): M ← M / (colsum + ε), then I − 1 times: M ← M / (rowsum + ε),
M ← M / (colsum + ε). Everything is float32; u and h' are rounded once to the compute dtype. The embedding
enters as N copies; the head averages the streams before the final norm (`collapse_streams`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

HIGHEST = jax.lax.Precision.HIGHEST


class HyperConnection(nnx.Module):
    def __init__(self, dim: int, streams: int, *, iters: int, eps: float, norm_eps: float, rngs: nnx.Rngs):
        self.n, self.iters, self.eps, self.norm_eps = streams, iters, eps, norm_eps
        width = (2 + streams) * streams
        self.fn = nnx.Param(
            nnx.initializers.normal(0.02)(rngs.params(), (streams * dim, width), jnp.float32),
            logical_axes=(None, None),
        )
        # random, not the released init (zeros / ones), so that tests see every term
        self.base = nnx.Param(0.1 * jax.random.normal(rngs.params(), (width,), jnp.float32), logical_axes=(None,))
        self.scale = nnx.Param(1.0 + 0.1 * jax.random.normal(rngs.params(), (3,), jnp.float32), logical_axes=(None,))

    def weights(self, h: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Streams h [B,T,N,D] -> (pre [B,T,N], post [B,T,N], M [B,T,N,N]) float32."""
        n = self.n
        flat = h.reshape(*h.shape[:-2], -1).astype(jnp.float32)
        flat = flat * jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + self.norm_eps)
        mix = jnp.einsum("...i,io->...o", flat, self.fn[...], precision=HIGHEST)
        base, scale = self.base[...], self.scale[...]
        pre = jax.nn.sigmoid(mix[..., :n] * scale[0] + base[:n]) + self.eps
        post = 2.0 * jax.nn.sigmoid(mix[..., n : 2 * n] * scale[1] + base[n : 2 * n])
        comb = mix[..., 2 * n :].reshape(*mix.shape[:-1], n, n) * scale[2] + base[2 * n :].reshape(n, n)
        comb = jax.nn.softmax(comb, axis=-1) + self.eps
        comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (jnp.sum(comb, axis=-1, keepdims=True) + self.eps)
            comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + self.eps)
        return pre, post, comb

    def __call__(self, h: jax.Array, block) -> jax.Array:
        """h' = post ⊗ block(Σ pre_n h_n) + Mᵀ h. `block` maps [B,T,D] -> ([B,T,D], aux); returns (h', aux)."""
        pre, post, comb = self.weights(h)
        u = jnp.einsum("...n,...nd->...d", pre, h.astype(jnp.float32), precision=HIGHEST).astype(h.dtype)
        y, aux = block(u)
        mixed = jnp.einsum("...ji,...jd->...id", comb, h.astype(jnp.float32), precision=HIGHEST)
        out = post[..., None] * y.astype(jnp.float32)[..., None, :] + mixed
        return out.astype(h.dtype), aux


def expand_streams(x: jax.Array, n: int) -> jax.Array:
    """The embedding [B,T,D] as N identical streams [B,T,N,D]."""
    return jnp.broadcast_to(x[..., None, :], (*x.shape[:-1], n, x.shape[-1]))


def collapse_streams(h: jax.Array) -> jax.Array:
    """The head's reduction: the unweighted mean of the streams [B,T,N,D] -> [B,T,D] (float32 sum, one rounding)."""
    return jnp.mean(h.astype(jnp.float32), axis=-2).astype(h.dtype)
