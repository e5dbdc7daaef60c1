"""Layout of the paged caches shared by the cache code and the attention ops.

A pool `pages [P, G, ...]` holds P pages of G token slots; `page_table [B, n]` lists the pages of each
sequence in order, so token position p of sequence b lives at pool row `page_table[b, p // G] * G + p % G`.
A contiguous tensor [B, S, ...] is the special case `pages = x`, `G = S`, `page_table = arange(B)[:, None]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def contiguous_as_pages(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """View x [B, S, ...] as a pool of B pages of S slots, without copying."""
    return x, jnp.arange(x.shape[0], dtype=jnp.int32)[:, None]


def slot_index(page_table: jax.Array, positions: jax.Array, page_size: int) -> jax.Array:
    """Pool row (page * G + offset) of each position; positions [B, ...] -> same shape, int32."""
    b = positions.shape[0]
    flat = positions.reshape(b, -1)
    page = jnp.take_along_axis(page_table, jnp.clip(flat // page_size, 0, page_table.shape[1] - 1), axis=1)
    return (page * page_size + flat % page_size).reshape(positions.shape).astype(jnp.int32)


def gather_pages(pages: jax.Array, page_table: jax.Array) -> jax.Array:
    """All slots of every sequence in position order: [P, G, ...] x [B, n] -> [B, n * G, ...]."""
    b, n = page_table.shape
    return pages[page_table].reshape(b, n * pages.shape[1], *pages.shape[2:])


def gather_rows(pages: jax.Array, page_table: jax.Array, positions: jax.Array) -> jax.Array:
    """Rows at positions [B, ...] (negative = invalid, returns row 0 there) -> [B, ..., *pages.shape[2:]]."""
    g = pages.shape[1]
    rows = slot_index(page_table, jnp.maximum(positions, 0), g)
    return pages.reshape(-1, *pages.shape[2:])[rows]


def write_rows(
    pages: jax.Array, page_table: jax.Array, positions: jax.Array, valid: jax.Array, values: jax.Array
) -> jax.Array:
    """Scatter values [B, T, ...] into positions [B, T]; entries with valid=False are dropped."""
    p, g = pages.shape[:2]
    rows = slot_index(page_table, positions, g)
    rows = jnp.where(valid, rows, p * g)  # out of range -> dropped by mode="drop"
    flat = pages.reshape(p * g, *pages.shape[2:])
    flat = flat.at[rows.reshape(-1)].set(values.reshape(-1, *values.shape[2:]).astype(pages.dtype), mode="drop")
    return flat.reshape(pages.shape)


def dequantized(values: jax.Array, scales: jax.Array, dtype) -> jax.Array:
    """An FP8 pool's rows: [..., L] E4M3 values x [..., L / tile] float32 scales -> [..., L] in dtype."""
    tile = values.shape[-1] // scales.shape[-1]
    dense = values.astype(jnp.float32).reshape(*values.shape[:-1], -1, tile) * scales[..., None].astype(jnp.float32)
    return dense.reshape(values.shape).astype(dtype)


def merge_splits(out: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Partial attention results over disjoint key sets merged exactly (flash-decoding): out [R,S,N,L] (each of
    the S parts softmax-normalised over its keys), lse [R,S,N] -> ([R,N,L] float32, [R,N]); a row no part saw
    anything of gets 0 and -inf."""
    m = jnp.max(lse, axis=1, keepdims=True)
    m = jnp.where(jnp.isneginf(m), 0.0, m)
    w = jnp.exp(lse - m)  # [R,S,N]
    total = jnp.sum(w, axis=1)
    o = jnp.einsum("rsn,rsnl->rnl", w, out.astype(jnp.float32)) / jnp.where(total > 0, total, 1.0)[..., None]
    return o, jnp.log(total) + m[:, 0]
