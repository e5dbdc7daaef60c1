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
