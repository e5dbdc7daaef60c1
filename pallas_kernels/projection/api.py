"""Public entry point of a bias-free projection y = x W for decode-sized row counts."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import registry
from pallas_kernels.projection.kernel import ROWS, gemv_group_partials, narrow, tile_starts
from pallas_kernels.projection.reference import project_reference
from pallas_kernels.projection.tuning import MAX_ROWS, MAX_SPLIT_K, TARGET_PROGRAMS


@dataclasses.dataclass(frozen=True)
class SplitK:
    """A one-row projection output left as the GEMV kernel's split-K partial sums: columns [start, start +
    width) of `parts` [S, W] float32, whose sum over S rounded to `dtype` is the value (`value()`), shaped
    `lead` + (width,). Pallas consumers (`project_group`, `linear_attention.kda_decode_layer`) add the S rows
    themselves where XLA would otherwise run one reduction kernel per output between two Pallas calls — at a
    batch-1 decode step each such kernel costs about as much as its consumer's work."""

    parts: jax.Array
    start: int
    width: int
    lead: tuple
    dtype: Any

    @property
    def shape(self) -> tuple:
        return (*self.lead, self.width)

    def value(self) -> jax.Array:
        y = jnp.sum(self.parts[:, self.start : self.start + self.width], axis=0)
        return y.reshape(self.shape).astype(self.dtype)


jax.tree_util.register_dataclass(SplitK, data_fields=["parts"], meta_fields=["start", "width", "lead", "dtype"])


def materialize(x):
    """x's value: a `SplitK` summed (one XLA reduction), anything else as it is."""
    return x.value() if isinstance(x, SplitK) else x


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


def auto_uses_kernel(x: jax.Array, w: jax.Array) -> bool:
    """Whether `project(x, w, impl="auto")` runs a kernel (`registry.resolve("projection", ...)`): callers
    that keep their own XLA path otherwise ask first."""
    return _choice(x, w, "auto").impl == "pallas"


def launch_group(x: jax.Array, w: jax.Array) -> tuple | None:
    """The key under which `project_group(impl="pallas")` can take (x, w) in one launch with the other pairs of
    the same key, or None where `project(x, w, impl="auto")` runs no kernel. Weights with an output tile of 64
    or more group at the tile they all divide into, with narrow power-of-two ones (one column per head) in one
    padded tile each; other narrow ones apart, so they do not shrink the wide weights' tiles."""
    if not auto_uses_kernel(x, w):
        return None
    fits = auto_tiles(*w.shape)[0] >= 64 or narrow(w.shape[1], 64)
    return (w.shape[0], str(w.dtype), tuple(x.shape), fits)


def _choice(x, w, impl: str) -> registry.Choice:
    rows = math.prod(x.shape[:-1])
    tiles = auto_tiles(*w.shape)
    split_k = auto_split_k(*w.shape, *tiles) if tiles is not None else 1
    return registry.resolve("projection", impl, rows=rows, itemsize=w.dtype.itemsize, tiles=tiles, split_k=split_k)


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
    split partials added in XLA, x cast to w's dtype, one row padded to 16 in the kernel, more rows before it:
    `project_group` of one weight), or "auto" (`registry.resolve("projection", ...)`). Tiles: `block_n` /
    `block_k` powers of two (default `auto_tiles`), `split_k` a divisor of K / block_k (default
    `auto_split_k`).
    """
    registry.check_impl("projection", impl)
    if w.ndim != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"project: x [..., K] and w [K, N] must agree on K; got x {x.shape}, w {w.shape}")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    impl = _choice(x, w, impl).impl
    if impl == "reference":
        return project_reference(x, w).astype(out_dtype)
    if auto_tiles(*w.shape) is None and (block_n is None or block_k is None):
        raise ValueError(f"project: w {w.shape} has no power-of-two tiles of at least 16; pass impl='reference'")
    return project_group(
        x, [w], impl="pallas", out_dtype=out_dtype, block_n=block_n, block_k=block_k, split_k=split_k,
        num_warps=num_warps, num_stages=num_stages, interpret=interpret,
    )[0]  # fmt: skip


def kernel_rows(x: jax.Array, dtype) -> jax.Array:
    """x [..., K] as the kernels take it: one row as [1, K] (padded in the kernel), else padded to 16 rows."""
    rows, kdim = math.prod(x.shape[:-1]), x.shape[-1]
    x2 = x.reshape(rows, kdim).astype(dtype)
    return x2 if rows == 1 else jnp.pad(x2, [(0, ROWS - rows), (0, 0)])


def group_tiles(kdim: int, widths) -> tuple[int, int] | None:
    """(block_n, block_k) shared by weights [kdim, N_i]: the largest power-of-two tile <= 128 dividing every
    N_i of 64 or more, at least 16, the narrower ones fitting one tile each (`kernel.narrow`; else every N_i
    divides it); None if there is none."""
    wide = [n for n in widths if n >= 64]
    bn = _largest_pow2_tile(math.gcd(*wide), 128) if wide else None
    if bn is None or not all(n % bn == 0 or narrow(n, bn) for n in widths):
        bn = _largest_pow2_tile(math.gcd(*widths), 128)
    bk = _largest_pow2_tile(kdim, 64)
    return None if bn is None or bk is None else (bn, bk)


def project_group(
    xs,
    ws,
    *,
    impl: str = "auto",
    out_dtype=None,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    interpret: bool | None = None,
    lazy: bool = False,
) -> list:
    """[x_i W_i] for several weights of the same K: `project` for each, with impl="pallas" one launch for all.

    xs: one array [..., K] shared by every weight, or one per weight (same shape; an input given twice, the
    same array object, is streamed once); ws: weights [K, N_i]. Returns a list of [..., N_i] in out_dtype
    (default the first x's dtype). impl: "reference" (each through `project`'s reference), "pallas"
    (`kernel.gemv_group_partials`: one grid over all the weights' output tiles, the partials of all of them
    added in one XLA reduction), or "auto" (the kernel where `registry.resolve` picks it for every pair, else
    `project(impl="auto")` one by one). Tiles default to `group_tiles`, the split to `auto_split_k` over all
    the output tiles together.

    An input may be a `SplitK` (another call's partial sums): the kernel adds its partials itself where they
    line up with its slabs, anything else takes its `value()`. lazy: a one-row kernel call returns `SplitK`s
    (the partials unreduced, for a Pallas consumer), every other path arrays.
    """
    registry.check_impl("projection", impl)
    ws = list(ws)
    if not ws:
        raise ValueError("project_group: no weights given")
    xs = [xs] * len(ws) if hasattr(xs, "shape") else list(xs)  # one array / SplitK, or a sequence
    if len(xs) != len(ws):
        raise ValueError(f"project_group: {len(xs)} inputs for {len(ws)} weights; give one, or one per weight")
    lead, kdim = xs[0].shape[:-1], xs[0].shape[-1]
    for i, (x, w) in enumerate(zip(xs, ws, strict=True)):
        if x.shape != xs[0].shape:
            raise ValueError(f"project_group: input {i} has shape {x.shape}, input 0 {xs[0].shape}; all must agree")
        if w.ndim != 2 or w.shape[0] != kdim:
            raise ValueError(f"project_group: weight {i} {w.shape} must be [K, N] with K = {kdim} (x {x.shape})")
    if len({w.dtype for w in ws}) != 1:
        raise ValueError(f"project_group: the weights' dtypes differ: {[str(w.dtype) for w in ws]}")
    out_dtype = xs[0].dtype if out_dtype is None else out_dtype
    if impl == "auto":
        shapes = [jax.ShapeDtypeStruct(x.shape, w.dtype) for x, w in zip(xs, ws, strict=True)]
        impl = "pallas" if all(auto_uses_kernel(x, w) for x, w in zip(shapes, ws, strict=True)) else None
        if impl is None:
            return [project(materialize(x), w, impl="auto", out_dtype=out_dtype) for x, w in zip(xs, ws, strict=True)]
    if impl == "reference":
        return [project(materialize(x), w, impl="reference", out_dtype=out_dtype) for x, w in zip(xs, ws, strict=True)]
    rows = math.prod(lead)
    if rows > MAX_ROWS:
        raise ValueError(f"project_group: the kernel takes at most {MAX_ROWS} rows, got {rows} (x {xs[0].shape})")
    widths = [w.shape[1] for w in ws]
    tiles = group_tiles(kdim, widths)
    block_n = block_n or (tiles[0] if tiles else None)
    block_k = block_k or (tiles[1] if tiles else None)
    if block_n is None or block_k is None:
        raise ValueError(
            f"project_group: weights {[w.shape for w in ws]} share no power-of-two tiles of at least 16; "
            "pass impl='reference' or group them differently"
        )
    split_k = split_k or auto_split_k(kdim, sum(-(-n // block_n) * block_n for n in widths), block_n, block_k)
    interpret = registry.interpret_default(interpret)
    unique, x_of = [], []
    for x in xs:  # an input passed for several weights is streamed once
        hit = next((n for n, u in enumerate(unique) if u is x), None)
        x_of.append(len(unique) if hit is None else hit)
        if hit is None:
            unique.append(x)
    ks = kdim // split_k
    # partial sums the kernel can add itself: one row, already in the weights' dtype, lined up with its slabs
    direct = [isinstance(x, SplitK) and x.dtype == ws[0].dtype and x.start % ks == 0 for x in unique]
    parts = gemv_group_partials(
        tuple(x.parts if d else kernel_rows(materialize(x), ws[0].dtype) for x, d in zip(unique, direct, strict=True)),
        tuple(ws), x_of=tuple(x_of), block_n=block_n, block_k=block_k, split_k=split_k,
        x_starts=tuple(x.start if d else None for x, d in zip(unique, direct, strict=True)) if any(direct) else None,
        interpret=interpret, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    starts = tile_starts(widths, block_n)
    if lazy and rows == 1:
        return [SplitK(parts, st, n, tuple(lead), jnp.dtype(out_dtype)) for st, n in zip(starts, widths, strict=True)]
    y = jnp.sum(parts, axis=0)  # [Σ N] for one row, else [16, Σ N]
    y = y[None] if rows == 1 else y[:rows]
    return [y[:, st : st + n].reshape(*lead, n).astype(out_dtype) for st, n in zip(starts, widths, strict=True)]
