"""Building blocks shared by every layer: projections, norms and the dtype policy.

Checkpoints store a torch `Linear` weight as [out, in]; our `kernel` is [in, out] (the loader transposes).
Every parameter carries `logical_axes` metadata; `sharding/rules.py` maps those names to mesh axes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

# Initialisers used for random models (tests, benchmarks). Real weights come from checkpoints.
_normal = nnx.initializers.normal(stddev=0.02)


@dataclasses.dataclass(frozen=True)
class DTypes:
    """dtype policy: `compute` for activations, `param` for most weights.

    Parameters that every reference keeps in float32 (KDA A_log / dt_bias, router bias, AttnRes queries and
    norms, indexer head weights) ignore `param` on purpose.
    """

    compute: jnp.dtype = jnp.float32
    param: jnp.dtype = jnp.float32


def linear(
    in_dim: int,
    out_dim: int,
    axes: tuple[str | None, str | None],
    dt: DTypes,
    rngs: nnx.Rngs,
    *,
    param_dtype=None,
    stddev: float | None = None,
) -> nnx.Linear:
    """A bias-free projection whose kernel [in, out] carries logical axis names."""
    init = _normal if stddev is None else nnx.initializers.normal(stddev=stddev)
    return nnx.Linear(
        in_dim,
        out_dim,
        use_bias=False,
        dtype=dt.compute,
        param_dtype=param_dtype or dt.param,
        kernel_init=nnx.with_metadata(init, logical_axes=axes),
        rngs=rngs,
    )


class RMSNorm(nnx.Module):
    """y = w ⊙ cast(x · (mean(x²) + eps)^-1/2), statistics in float32 (HF: weight applied after the cast)."""

    def __init__(self, dim: int, *, eps: float, dt: DTypes, param_dtype=None, axis_name: str = "norm"):
        self.eps = eps
        self.dtype = dt.compute
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype or dt.param), logical_axes=(axis_name,))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(self.dtype) * y.astype(self.dtype)


class LayerNorm(nnx.Module):
    """Mean-centred LayerNorm with weight and bias, computed in float32 (the DSA indexer's k_norm)."""

    def __init__(self, dim: int, *, eps: float, dt: DTypes):
        self.eps = eps
        self.dtype = dt.compute
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32), logical_axes=("norm",))
        self.bias = nnx.Param(jnp.zeros((dim,), jnp.float32), logical_axes=("norm",))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mu = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mu), axis=-1, keepdims=True)
        y = (x32 - mu) * jax.lax.rsqrt(var + self.eps) * self.weight[...] + self.bias[...]
        return y.astype(self.dtype)


class SwiGLU(nnx.Module):
    """Dense MLP: down(SiLU(gate x) ⊙ up x); the product is formed in float32."""

    def __init__(self, dim: int, hidden: int, dt: DTypes, rngs: nnx.Rngs):
        self.gate_proj = linear(dim, hidden, ("embed", "mlp"), dt, rngs)
        self.up_proj = linear(dim, hidden, ("embed", "mlp"), dt, rngs)
        self.down_proj = linear(hidden, dim, ("mlp", "embed"), dt, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., D] -> [..., D]
        g = self.gate_proj(x).astype(jnp.float32)
        u = self.up_proj(x).astype(jnp.float32)
        return self.down_proj((jax.nn.silu(g) * u).astype(x.dtype))
