"""Building blocks shared by every layer: projections, norms and the dtype policy.

Checkpoints store a torch `Linear` weight as [out, in]; our `kernel` is [in, out] (the loader transposes).
Every parameter carries `logical_axes` metadata; `sharding/rules.py` maps those names to mesh axes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.norm import norm_uses_kernel, rms_norm
from pallas_kernels.projection import SplitK, auto_uses_kernel, launch_group, materialize, project, project_group

# Initialisers used for random models (tests, benchmarks). Real weights come from checkpoints.
default_init = nnx.initializers.normal(stddev=0.02)


@dataclasses.dataclass(frozen=True)
class DTypes:
    """dtype policy: `compute` for activations, `param` for most weights.

    Parameters that every reference keeps in float32 (KDA A_log / dt_bias, router bias, AttnRes queries and
    norms, indexer head weights) ignore `param` on purpose.
    """

    compute: jnp.dtype = jnp.float32
    param: jnp.dtype = jnp.float32
    fp8_weights: bool = False  # projections hold FP8 E4M3 kernels with 128 x 128 block scales


FP8_BLOCK = 128


def block_scales_shape(in_dim: int, out_dim: int) -> tuple[int, int]:
    return -(-in_dim // FP8_BLOCK), -(-out_dim // FP8_BLOCK)


def quantize_fp8_blocks(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w [in, out] -> (E4M3 [in, out], float32 scales [in/128, out/128]) with w ≈ w8 * scale per 128 x 128
    block (DeepSeek's weight format, scale = amax / 448)."""
    i, o = w.shape
    bi, bo = block_scales_shape(i, o)
    wp = jnp.pad(w.astype(jnp.float32), ((0, bi * FP8_BLOCK - i), (0, bo * FP8_BLOCK - o)))
    blocks = wp.reshape(bi, FP8_BLOCK, bo, FP8_BLOCK)
    scale = jnp.maximum(jnp.max(jnp.abs(blocks), axis=(1, 3)), 1e-12) / 448.0
    w8 = jnp.clip(blocks / scale[:, None, :, None], -448.0, 448.0).astype(jnp.float8_e4m3fn)
    return w8.reshape(bi * FP8_BLOCK, bo * FP8_BLOCK)[:i, :o], scale


def dequantize_fp8_blocks(w8: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    i, o = w8.shape
    full = jnp.repeat(jnp.repeat(scale, FP8_BLOCK, axis=0)[:i], FP8_BLOCK, axis=1)[:, :o]
    return (w8.astype(jnp.float32) * full).astype(dtype)


class Fp8Linear(nnx.Module):
    """y = x · (kernel ⊙ block scales): an FP8-resident projection (DeepSeek-V3 style 128 x 128 blocks).

    `kernel` [in, out] float8_e4m3fn and `kernel_scale_inv` [in/128, out/128] float32 (the checkpoint's
    `weight_scale_inv`, transposed). This reference dequantizes to the compute dtype before the matmul."""

    def __init__(self, in_dim: int, out_dim: int, axes, dt: DTypes, rngs: nnx.Rngs, *, stddev: float = 0.02):
        self.dtype = dt.compute
        w8, scale = quantize_fp8_blocks(stddev * jax.random.normal(rngs.params(), (in_dim, out_dim)))
        self.kernel = nnx.Param(w8, logical_axes=axes)
        self.kernel_scale_inv = nnx.Param(scale, logical_axes=(None, None))

    def dense_kernel(self, dtype) -> jax.Array:
        return dequantize_fp8_blocks(self.kernel[...], self.kernel_scale_inv[...], dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.dot(x.astype(self.dtype), self.dense_kernel(self.dtype))


def dense_kernel(layer: nnx.Module, dtype) -> jax.Array:
    """The [in, out] kernel of a projection as a dense array (dequantized when FP8-resident)."""
    if isinstance(layer, Fp8Linear):
        return layer.dense_kernel(dtype)
    return layer.kernel[...].astype(dtype)


def own_kernels(*xs: jax.Array) -> tuple[jax.Array, ...]:
    """The values as XLA computes them, each ending its own fusion (`lax.optimization_barrier`).

    At one row per step XLA rewrites x @ W as multiply + reduce and may fuse that reduce into a consumer
    such as a concatenate or a cache update, where every output element then runs its whole reduction as one
    serial loop (a KDA layer's q/k/v projections fused into the short-conv concatenate took most of that
    layer's batch-1 decode step; docs/performance.md#projections). Placed where projections meet such
    consumers; it changes no value.
    """
    return jax.lax.optimization_barrier(xs)


def linear(
    in_dim: int,
    out_dim: int,
    axes: tuple[str | None, str | None],
    dt: DTypes,
    rngs: nnx.Rngs,
    *,
    param_dtype=None,
    stddev: float | None = None,
) -> nnx.Module:
    """A bias-free projection whose kernel [in, out] carries logical axis names (FP8 blocks when the policy
    asks for FP8-resident weights)."""
    if dt.fp8_weights:
        return Fp8Linear(in_dim, out_dim, axes, dt, rngs, stddev=0.02 if stddev is None else stddev)
    init = default_init if stddev is None else nnx.initializers.normal(stddev=stddev)
    return Projection(
        in_dim,
        out_dim,
        use_bias=False,
        dtype=dt.compute,
        param_dtype=param_dtype or dt.param,
        kernel_init=nnx.with_metadata(init, logical_axes=axes),
        rngs=rngs,
    )


class Projection(nnx.Linear):
    """`nnx.Linear` (same parameters, same values) whose calls go through the `projection` op's
    weight-streaming GEMV kernel where `projection.auto_uses_kernel` says so — by default one row (a batch-1
    decode step) on a GPU, where XLA's one-row product is slower (docs/performance.md#projections)."""

    def __call__(self, inputs: jax.Array) -> jax.Array:
        if self.bias is None:
            kernel = self.kernel[...]
            w = kernel.astype(self.dtype or kernel.dtype)
            x = inputs.astype(w.dtype)
            if auto_uses_kernel(x, w):
                return project(x, w, impl="pallas")
        return super().__call__(inputs)


def project_many(
    calls: Sequence[tuple[nnx.Module, jax.Array | SplitK]], *, own_xla: bool = False, lazy: bool = False
) -> list:
    """[layer(x) for layer, x in calls], the same values; projections that `Projection` would each send to the
    GEMV kernel (a batch-1 decode step on a GPU) and that share K, dtype and output tile run as one launch
    (`projection.project_group`, grouped by `projection.launch_group`). A batch-1
    decode step is hundreds of microsecond-sized kernels, so a KDA layer's six projections of x in one
    launch instead of six (each with its own pad and partial-sum kernels) is time saved at every step;
    prefill and larger batches take XLA's path as before.
    own_xla: the outputs XLA computes end their own fusions (`own_kernels`); the kernel's outputs do not need
    it (their partial sums are a few adds per element, cheap to fuse into any consumer).
    lazy: the kernel's outputs come back as `projection.SplitK` partial sums (for Pallas consumers that add
    them themselves, and as inputs here: a second projection reads the first's partials directly); XLA's
    outputs are arrays either way."""
    outs: list[jax.Array | None] = [None] * len(calls)
    groups: dict[tuple, list] = {}
    cast: dict[tuple, jax.Array] = {}  # one converted input per (input object, dtype): a group streams it once
    for i, (layer, x) in enumerate(calls):
        if isinstance(layer, Projection) and layer.bias is None:
            w = layer.kernel[...]
            w = w.astype(layer.dtype or w.dtype)
            key = (id(x), str(w.dtype))
            if key not in cast:  # partial sums in the weights' dtype stay unreduced: the kernel adds them
                same = isinstance(x, SplitK) and x.dtype == w.dtype
                cast[key] = x if same else materialize(x).astype(w.dtype)
            xw = cast[key]
            group = launch_group(jax.ShapeDtypeStruct(xw.shape, w.dtype), w)
            if group is not None:
                groups.setdefault(group, []).append((i, xw, w))
                continue
        y = layer(materialize(x))
        outs[i] = own_kernels(y)[0] if own_xla else y
    for members in groups.values():
        ys = project_group([m[1] for m in members], [m[2] for m in members], impl="pallas", lazy=lazy)
        for (i, _, _), y in zip(members, ys, strict=True):
            outs[i] = y
    return outs


class RMSNorm(nnx.Module):
    """y = w ⊙ cast(x · (mean(x²) + eps)^-1/2), statistics in float32 (HF: weight applied after the cast).

    zero_centered (Qwen3-Next): the weight is stored as w and applied as 1 + w, in float32 before the cast:
    y = cast(x · (mean(x²) + eps)^-1/2 · (1 + w))."""

    def __init__(
        self, dim: int, *, eps: float, dt: DTypes, param_dtype=None, axis_name: str = "norm", zero_centered=False
    ):
        self.eps = eps
        self.dtype = dt.compute
        self.zero_centered = zero_centered
        init = jnp.zeros if zero_centered else jnp.ones
        self.weight = nnx.Param(init((dim,), param_dtype or dt.param), logical_axes=(axis_name,))

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.zero_centered:
            x32 = x.astype(jnp.float32)
            y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
            return (y * (1.0 + self.weight[...].astype(jnp.float32))).astype(self.dtype)
        # `pallas_kernels.norm` (its reference is this formula); the kernel at decode sizes where switched on
        return rms_norm(x, self.weight[...], eps=self.eps, out_dtype=self.dtype)[1]

    def add(self, residual: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(residual + x, this norm of it): one kernel where `pallas_kernels.norm.norm_uses_kernel` says so —
        an explicit opt-in (`use_pallas(ops=["rms_norm"])`), measured slower than XLA's fused add + norm."""
        if residual.dtype == x.dtype and not self.zero_centered and norm_uses_kernel(x):
            return rms_norm(x, self.weight[...], eps=self.eps, residual=residual, out_dtype=self.dtype)
        h = residual + x
        return h, self(h)


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
    """Dense MLP: down(SiLU(gate x) ⊙ up x); the product is formed in float32.

    limit: the clamped SwiGLU (GLM-5.3-Flash): gate ← min(gate, limit), up ← clip(up, −limit, limit) on the
    float32 products before they meet (as `pallas_kernels.moe`'s experts clamp); None: plain SwiGLU."""

    def __init__(self, dim: int, hidden: int, dt: DTypes, rngs: nnx.Rngs, *, limit: float | None = None):
        from pallas_kernels.moe.reference import check_swiglu_limit  # the MoE experts' rule for the same limit

        self.limit = check_swiglu_limit(limit, "SwiGLU", "limit")
        self.gate_proj = linear(dim, hidden, ("embed", "mlp"), dt, rngs)
        self.up_proj = linear(dim, hidden, ("embed", "mlp"), dt, rngs)
        self.down_proj = linear(hidden, dim, ("mlp", "embed"), dt, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., D] -> [..., D]
        g, u = (y.astype(jnp.float32) for y in project_many([(self.gate_proj, x), (self.up_proj, x)]))
        if self.limit is not None:
            g, u = jnp.minimum(g, self.limit), jnp.maximum(jnp.minimum(u, self.limit), -self.limit)
        return self.down_proj((jax.nn.silu(g) * u).astype(x.dtype))
