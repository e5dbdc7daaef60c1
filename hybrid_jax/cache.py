"""Decode-time state: fixed-size KDA states and paged MLA / indexer caches.

* KDA layer: `conv` [B, W-1, 3*N*K] (the last W-1 raw q|k|v projections, newest last) and
  `recurrent` [B, N, K, V] float32.
* MLA layer: `kv` [P, G, L+R] latent pool (compressed latent c and the shared rope key per token);
  sparse layers add `index_k` [P, G, H_I], the indexer's key pool.
* Shared by all layers: `page_table` [B, n] (pages of each sequence, see `pallas_kernels.paged`) and
  `lengths` [B] (tokens cached so far). `max_len` is the capacity per sequence: going past it is an error.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KDAState:
    conv: jax.Array  # [B, W-1, 3*N*K]
    recurrent: jax.Array  # [B, N, K, V] float32


@struct.dataclass
class MLAState:
    kv: jax.Array  # [P, G, L+R]
    index_k: jax.Array | None  # [P, G, H_I] for sparse layers


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
class StepInfo:
    """What every layer needs to know about the tokens of one forward call."""

    positions: jax.Array  # [B, T] absolute position of each token
    valid: jax.Array  # [B, T] bool: a real token (a prefix of each row)
    n_new: jax.Array  # [B] int32 real tokens per row
    page_table: jax.Array  # [B, n]; arange(B)[:, None] when running without a cache
    kv_lengths: jax.Array  # [B] keys visible after this call (cache length + n_new)
    mode: str = struct.field(pytree_node=False)  # "prefill" or "decode"


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
