"""Decode-time state: fixed-size KDA states and paged MLA / indexer caches.

* KDA layer: `conv` [B, W-1, 3*N*K] (the last W-1 raw q|k|v projections, newest last) and
  `recurrent` [B, N, K, V] float32.
* MLA layer: `latent` [P, G, L] pool of compressed latents c, `rope` [P, G, R] of shared rope keys;
  sparse layers add `index_k` [P, G, H_I], the indexer's key pool (a KPool indexer keeps one pooled key per
  pool of `index_kpool` tokens there, at pool position j, plus `index_tail` [B, kpool, 2 H_I], the raw keys and
  gate logits of the pool still filling up; a layer sharing another's selection keeps neither).
  A pool stores its rows dense, or quantized (FP8 per-tile for the latent, MXFP8 for the indexer keys, see
  `hybrid_jax.quant`), so the memory really shrinks; writing a token quantizes and touches only that token's rows.
* A speculative verify step (`HybridLM.verify`) returns a `PendingCache`: the pools hold every verified token,
  the per-sequence states one snapshot per accepted-prefix length; `HybridLM.commit` keeps a prefix per row
  and clears the pool rows of the rest.
* Shared by all layers: `page_table` [B, n] (pages of each sequence, see `pallas_kernels.paged`) and
  `lengths` [B] (tokens cached so far). `max_len` is the capacity per sequence: going past it is an error.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from hybrid_jax.quant.formats import (
    MX_BLOCK,
    dequantize_kv_fp8,
    dequantize_mxfp8,
    quantize_kv_fp8,
    quantize_mxfp8,
)
from pallas_kernels.paged import gather_pages, write_rows

POOL_FORMATS = ("dense", "fp8", "mxfp8")


def quantize_rows(x: jax.Array, fmt: str, tile: int, dtype) -> tuple[jax.Array, jax.Array | None]:
    """Rows [..., W] -> (values, scales) in a pool format."""
    if fmt == "fp8":
        return quantize_kv_fp8(x, tile)
    if fmt == "mxfp8":
        return quantize_mxfp8(x)
    return x.astype(dtype), None


def dequantize_rows(values: jax.Array, scales: jax.Array | None, fmt: str, dtype) -> jax.Array:
    if fmt == "fp8":
        return dequantize_kv_fp8(values, scales, dtype)
    if fmt == "mxfp8":
        return dequantize_mxfp8(values, scales, dtype=dtype)
    return values.astype(dtype)


@struct.dataclass
class Pool:
    """Per-token rows of one layer in pages: values [P, G, W] and, when quantized, scales [P, G, W / block]."""

    values: jax.Array
    scales: jax.Array | None
    fmt: str = struct.field(pytree_node=False, default="dense")
    tile: int = struct.field(pytree_node=False, default=0)

    @classmethod
    def empty(cls, num_pages: int, page_size: int, width: int, dtype, fmt: str = "dense", tile: int = 0) -> Pool:
        if fmt not in POOL_FORMATS:
            raise ValueError(f"pool format {fmt!r} not in {POOL_FORMATS}")
        block = {"fp8": tile, "mxfp8": MX_BLOCK}.get(fmt)
        if block and width % block:
            raise ValueError(f"pool width {width} is not a multiple of the {fmt} block {block}")
        shape = (num_pages, page_size, width)
        if fmt == "dense":
            return cls(jnp.zeros(shape, dtype), None, fmt, tile)
        # One zero row quantized, then broadcast: rows quantize independently, so this is the pool of quantized
        # zeros — without a [P, G, W] quantization of a constant, which XLA would constant-fold while compiling
        # (36 s of the recall model's 500-row generate on the CPU).
        values, scales = quantize_rows(jnp.zeros((width,), jnp.float32), fmt, tile, dtype)
        return cls(jnp.broadcast_to(values, shape), jnp.broadcast_to(scales, shape[:2] + scales.shape), fmt, tile)

    @classmethod
    def from_rows(cls, rows: jax.Array, fmt: str, tile: int, dtype) -> Pool:
        """Contiguous rows [B, T, W] as a pool of B pages (page table arange(B)[:, None])."""
        values, scales = quantize_rows(rows, fmt, tile, dtype)
        return cls(values, scales, fmt, tile)

    def write(self, info: StepInfo, rows: jax.Array) -> Pool:
        values, scales = quantize_rows(rows, self.fmt, self.tile, self.values.dtype)
        new_values = write_rows(self.values, info.page_table, info.positions, info.valid, values)
        new_scales = None
        if scales is not None:
            new_scales = write_rows(self.scales, info.page_table, info.positions, info.valid, scales)
        return Pool(new_values, new_scales, self.fmt, self.tile)

    def clear(self, page_table: jax.Array, start: jax.Array, stop: jax.Array, count: int) -> Pool:
        """The rows at positions [start, stop) of each row (start, stop [B]; at most `count` of them) back to an
        empty pool's contents: what a rollback leaves where rejected tokens were written."""
        positions = start[:, None] + jnp.arange(count, dtype=jnp.int32)[None, :]
        valid = positions < stop[:, None]
        b = positions.shape[0]
        zeros = jnp.zeros((b, count, self.values.shape[-1]), jnp.float32)
        values, scales = quantize_rows(zeros, self.fmt, self.tile, self.values.dtype)
        new_values = write_rows(self.values, page_table, positions, valid, values)
        new_scales = None if scales is None else write_rows(self.scales, page_table, positions, valid, scales)
        return Pool(new_values, new_scales, self.fmt, self.tile)

    def read(self, dtype) -> jax.Array:
        """The dequantized pool [P, G, W] (what the reference ops read)."""
        return dequantize_rows(self.values, self.scales, self.fmt, dtype)

    def gather(self, page_table: jax.Array, dtype) -> jax.Array:
        """The rows of the pages `page_table` [B, n] names, in position order, dequantized: [B, n * G, W]
        (only those pages are read and converted)."""
        scales = None if self.scales is None else gather_pages(self.scales, page_table)
        return dequantize_rows(gather_pages(self.values, page_table), scales, self.fmt, dtype)


@struct.dataclass
class KDAState:
    conv: jax.Array  # [B, W-1, 3*N*K]
    recurrent: jax.Array  # [B, N, K, V] float32


@struct.dataclass
class MLAState:
    latent: Pool  # [P, G, L]
    rope: Pool | None  # [P, G, R]; None without a rope part (R = 0)
    index_k: Pool | None  # [P, G, H_I] for sparse layers with their own indexer (KPool: one row per pool)
    # KPool indexer: [B, kpool, 2 H_I] the keys | gate logits of each sequence's incomplete pool (slot = pos % kpool)
    index_tail: jax.Array | None = None


@struct.dataclass
class AttnState:
    """A gated GQA layer's cache: keys and values of every token, [P, G, N_kv * H] each (FP8 per tile when
    the KV cache is quantized)."""

    k: Pool
    v: Pool


@struct.dataclass
class HybridCache:
    layers: tuple
    page_table: jax.Array  # [B, n] int32
    lengths: jax.Array  # [B] int32
    max_len: int = struct.field(pytree_node=False)
    page_size: int = struct.field(pytree_node=False)

    @property
    def batch_size(self) -> int:
        return self.page_table.shape[0]


@struct.dataclass
class PendingCache:
    """What `HybridLM.verify` returns beside the logits: the cache after all `n_new` [B] verified tokens, where
    every per-sequence state (KDA recurrent and conv tails, KPool index tails) holds one snapshot per prefix of
    the block (axis 1, index j = after j tokens). `HybridLM.commit` keeps a prefix of each row."""

    cache: HybridCache
    n_new: jax.Array  # [B] int32
    block: int = struct.field(pytree_node=False)  # T, the block length (static)


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """Inside `jax.shard_map` over `axis`: each device holds the sequence pieces `table[device]` (equal slices,
    global piece indices) in that order; positions travel with the tokens."""

    axis: str
    table: tuple[tuple[int, ...], ...]

    @property
    def pieces(self) -> int:
        return len(self.table[0])

    def gather_sequence(self, x: jax.Array) -> jax.Array:
        """Local rows [B, T_local, ...] of every device -> the whole sequence [B, T, ...] in position order."""
        table = np.asarray(self.table)
        b, t_local = x.shape[:2]
        per = x.reshape(b, self.pieces, t_local // self.pieces, *x.shape[2:])
        gathered = jax.lax.all_gather(jnp.moveaxis(per, 1, 0), self.axis)  # [cp, pieces, B, L, ...]
        ordered = gathered.reshape(-1, *gathered.shape[2:])[np.argsort(table.reshape(-1))]  # [P, B, L, ...]
        return jnp.moveaxis(ordered, 0, 1).reshape(b, -1, *x.shape[2:])


@struct.dataclass
class StepInfo:
    """What every layer needs to know about the tokens of one forward call."""

    positions: jax.Array  # [B, T] absolute position of each token
    valid: jax.Array  # [B, T] bool: a real token (a prefix of each row)
    n_new: jax.Array  # [B] int32 real tokens per row
    page_table: jax.Array  # [B, n]; arange(B)[:, None] when running without a cache
    kv_lengths: jax.Array  # [B] keys visible after this call (cache length + n_new)
    mode: str = struct.field(pytree_node=False)  # "prefill", "decode" or "verify"
    cp: ContextParallel | None = struct.field(pytree_node=False, default=None)  # sequence split over devices
    # prefill only: per-sequence states also after every this many tokens of the call (`HybridLM.prefill`)
    snapshot_every: int | None = struct.field(pytree_node=False, default=None)

    @classmethod
    def uncached(cls, b: int, t: int) -> StepInfo:
        """A full causal forward of [B, T] tokens from position 0, without a cache."""
        return cls(
            positions=jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)), valid=jnp.ones((b, t), bool),
            n_new=jnp.full((b,), t, jnp.int32), page_table=jnp.arange(b, dtype=jnp.int32)[:, None],
            kv_lengths=jnp.full((b,), t, jnp.int32), mode="prefill",
        )  # fmt: skip


def store_rows(pool: Pool | None, rows: jax.Array, info: StepInfo, fmt: str, tile: int) -> Pool:
    """Write this call's rows into the pool; without a cache the new rows *are* the (contiguous) pool.
    Either way they pass through the pool's format, so cached and uncached runs see the same rounding.
    Context parallel: every device attends over the whole causal prefix, so the rows of all devices are
    gathered over the cp axis (and, with a cache, every device writes the same full set into its pool copy,
    which is the pool that decode then reads)."""
    if info.cp is not None:
        rows = info.cp.gather_sequence(rows)
        info = dataclasses.replace(
            info, positions=info.cp.gather_sequence(info.positions), valid=info.cp.gather_sequence(info.valid)
        )
    if pool is None:
        return Pool.from_rows(rows, fmt, tile, rows.dtype)
    return pool.write(info, rows)


def is_concrete(*xs) -> bool:
    """True when no argument is a tracer, so values can be checked eagerly and errors raised."""
    return not any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(xs))


def make_page_table(
    batch_size: int, max_len: int, page_size: int, *, num_pages: int | None = None, page_table=None
) -> jax.Array:
    """Default layout: sequence b owns pages [b*n, (b+1)*n). A given table is validated and returned."""
    n = -(-max_len // page_size)
    if page_table is None:
        if num_pages is not None and num_pages < batch_size * n:
            raise ValueError(
                f"num_pages={num_pages} < {batch_size * n} pages needed for batch {batch_size} "
                f"x max_len {max_len} (page size {page_size})"
            )
        return jnp.arange(batch_size * n, dtype=jnp.int32).reshape(batch_size, n)
    page_table = jnp.asarray(page_table, jnp.int32)
    if page_table.shape != (batch_size, n):
        raise ValueError(
            f"page_table shape {page_table.shape} != ({batch_size}, {n}) for max_len {max_len} "
            f"and page size {page_size}"
        )
    pool = num_pages if num_pages is not None else batch_size * n
    if is_concrete(page_table):
        lo, hi = int(page_table.min()), int(page_table.max())
        if lo < 0 or hi >= pool:
            raise ValueError(f"page_table entries span [{lo}, {hi}], outside the pool of {pool} pages")
    return page_table
