"""Public entry point of a bias-free projection y = x W for decode-sized row counts."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import AxisType

from pallas_kernels._pallas import auto_impl, forced_choice
from pallas_kernels.projection.kernel import ROWS, gemv_partials
from pallas_kernels.projection.reference import project_reference

IMPLS = ("auto", "reference", "pallas")
# The kernels take up to MAX_ROWS rows (one tensor-core tile). impl="auto" runs them for AUTO_MAX_ROWS: on the
# H200 (BENCHMARKS.md, small_m.py at 83d5e63, Kimi widths, chained calls) one row is where XLA loses — its
# multiply + reduce form took 0.029-0.039 ms per 2304 x 4096 / 4096 x 2304 / 2304 x 1024 / 2304 x 9216 weight
# against the kernel's 0.017-0.026 — while from 4 rows XLA's GEMM matches or beats the padded-MMA kernel
# (2304 x 4096 at 4 rows: 0.018 vs 0.026 ms). Weights wide enough to need no split (the 163840-wide lm_head:
# XLA 0.196 vs 0.203 ms) stay with XLA too.
MAX_ROWS = ROWS
AUTO_MAX_ROWS = 1
# Programs `auto_split_k` aims for: two per H200 SM, so that every SM streams weights while its other
# program waits on memory.
TARGET_PROGRAMS = 264
MAX_SPLIT_K = 32


def _largest_pow2_tile(n: int, cap: int) -> int | None:
    """The largest power of two <= cap dividing n, at least 16 (the tensor-core tile); None if none."""
    t = cap
    while t >= 16:
        if n % t == 0:
            return t
        t //= 2
    return None


def auto_tiles(kdim: int, width: int) -> tuple[int, int] | None:
    """(block_n, block_k) for w [kdim, width], or None when the shape has no 16-multiple tiles."""
    bn, bk = _largest_pow2_tile(width, 128), _largest_pow2_tile(kdim, 64)
    return None if bn is None or bk is None else (bn, bk)


def auto_split_k(kdim: int, width: int, block_n: int, block_k: int, target: int = TARGET_PROGRAMS) -> int:
    """The fewest contraction splits (a divisor of the K / BK slabs, up to MAX_SPLIT_K) that make `target`
    programs with the N / BN output tiles; the most allowed when none does."""
    slabs, tiles = kdim // block_k, width // block_n
    divisors = [s for s in range(1, min(slabs, MAX_SPLIT_K) + 1) if slabs % s == 0]
    return next((s for s in divisors if tiles * s >= target), divisors[-1])


def kernel_allowed() -> bool:
    """Whether a Pallas call may stand for the projection here: not under a multi-device mesh outside
    `shard_map` — XLA cannot partition a custom call, and would gather a tensor-parallel weight to every
    device for it (inside `shard_map`, with every axis manual, the call sees the local shard)."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.empty or math.prod(mesh.shape.values()) == 1 or all(t == AxisType.Manual for t in mesh.axis_types)


def kernel_supported(x: jax.Array, w: jax.Array) -> bool:
    """Shapes and dtypes the kernels take: at most MAX_ROWS rows, a 2-byte weight, 16-multiple tiles."""
    rows = math.prod(x.shape[:-1])
    return 0 < rows <= MAX_ROWS and w.dtype.itemsize == 2 and auto_tiles(*w.shape) is not None


def auto_uses_kernel(x: jax.Array, w: jax.Array) -> bool:
    """Whether `project(x, w, impl="auto")` runs a kernel (callers keep their own XLA path otherwise): inside
    a `use_pallas()` block covering "projection" wherever the kernels apply; by default on a GPU for
    AUTO_MAX_ROWS rows of a weight that needs a contraction split (rules above)."""
    supported = kernel_supported(x, w) and kernel_allowed()
    if supported and forced_choice("projection") is None:
        bn, bk = auto_tiles(*w.shape)
        supported = math.prod(x.shape[:-1]) <= AUTO_MAX_ROWS and auto_split_k(*w.shape, bn, bk) > 1
    return auto_impl("projection", supported)


def project(
    x: jax.Array,
    w: jax.Array,
    *,
    impl: str = "auto",
    out_dtype=None,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    interpret: bool | None = None,
) -> jax.Array:
    """x [..., K], w [K, N] -> x W [..., N] in out_dtype (default x's dtype), float32 accumulation.

    impl: "reference" (float32 jnp), "pallas" (a grid of output tiles x contraction splits streaming W, the
    split partials added in XLA, x cast to w's dtype and its rows padded to 16: `kernel.gemv_partials`), or
    "auto" (`auto_uses_kernel`: a kernel on
    a GPU for one row of a 2-byte weight that needs a split, outside a multi-device mesh — `kernel_allowed`
    — else the reference). Tiles: `block_n` / `block_k` powers of two (default
    `auto_tiles`), `split_k` a divisor of K / block_k (default `auto_split_k`).
    """
    if impl not in IMPLS:
        raise ValueError(f"project: impl must be one of {IMPLS}, got {impl!r}")
    if w.ndim != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"project: x [..., K] and w [K, N] must agree on K; got x {x.shape}, w {w.shape}")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if impl == "auto":
        impl = "pallas" if auto_uses_kernel(x, w) else "reference"
    if impl == "reference":
        return project_reference(x, w).astype(out_dtype)
    rows = math.prod(x.shape[:-1])
    if rows > MAX_ROWS:
        raise ValueError(f"project: the kernel takes at most {MAX_ROWS} rows, got {rows} (x {x.shape})")
    kdim, width = w.shape
    tiles = auto_tiles(kdim, width)
    block_n = block_n or (tiles[0] if tiles else None)
    block_k = block_k or (tiles[1] if tiles else None)
    if block_n is None or block_k is None:
        raise ValueError(f"project: w {w.shape} has no power-of-two tiles of at least 16; pass impl='reference'")
    split_k = split_k or auto_split_k(kdim, width, block_n, block_k)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    kw = dict(block_n=block_n, block_k=block_k, split_k=split_k, interpret=interpret, num_warps=num_warps,
              num_stages=num_stages)  # fmt: skip
    xp = jnp.pad(x.reshape(rows, kdim).astype(w.dtype), [(0, ROWS - rows), (0, 0)])
    y = jnp.sum(gemv_partials(xp, w, one_row=rows == 1, **kw), axis=0)  # [N] for one row, else [16, N]
    y = y[None] if rows == 1 else y[:rows]
    return y.reshape(*x.shape[:-1], width).astype(out_dtype)
