"""Exact Top-K by radix select: the same (values, indices) as `lax.top_k`, found by counting passes.

`lax.top_k` of the indexer's [queries, keys] scores costs about as much as a sort of every row, and in a
prefill the rows are as long as the context. Here the K-th largest score of each row is found digit by
digit — `digit_bits` bits per pass, each pass one counting reduction over the row (order-preserving uint32
image of the float32 scores) — then the row's elements above it, plus the lowest-position ties at it, are
compacted and only those K are sorted. Work: 32 / digit_bits counting passes + two prefix sums + one
compaction over the row, and a sort of K (not S) elements.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sortable_bits(x: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order (larger float, larger integer; -inf lowest of the non-NaN)."""
    b = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where((b >> 31) == 1, ~b, b | jnp.uint32(0x80000000))


def top_k_radix(x: jax.Array, k: int, *, digit_bits: int = 4) -> tuple[jax.Array, jax.Array]:
    """(values [..., k] float32, indices [..., k] int32) of the k largest entries of x [..., S] along the
    last axis, best first, ties to the lower index — equal to `jax.lax.top_k(x, k)` (x without NaN)."""
    s = x.shape[-1]
    if not 0 < k <= s:
        raise ValueError(f"top_k_radix: k={k} must be in [1, {s}]")
    if digit_bits not in (1, 2, 4, 8):
        raise ValueError(f"top_k_radix: digit_bits={digit_bits} must divide 32 (1, 2, 4 or 8)")
    lead = x.shape[:-1]
    u = sortable_bits(x)  # [..., S]
    tau = jnp.zeros(lead, jnp.uint32)  # invariant: at least k entries are >= tau
    digits = jnp.arange(1, 1 << digit_bits, dtype=jnp.uint32)
    for shift in range(32 - digit_bits, -1, -digit_bits):
        cand = tau[..., None] | (digits << shift)  # [..., D-1]
        counts = jnp.sum(u[..., None, :] >= cand[..., :, None], axis=-1, dtype=jnp.int32)  # non-increasing in d
        best = jnp.sum(counts >= k, axis=-1).astype(jnp.uint32)  # the largest digit that keeps k entries
        tau = tau | (best << shift)
    above = u > tau[..., None]
    ties = u == tau[..., None]
    need = k - jnp.sum(above, axis=-1, dtype=jnp.int32)  # ties taken at the threshold: the lowest positions
    chosen = above | (ties & (jnp.cumsum(ties, axis=-1, dtype=jnp.int32) <= need[..., None]))
    slot = jnp.where(chosen, jnp.cumsum(chosen, axis=-1, dtype=jnp.int32) - 1, k)  # k: dropped
    flat_slot = slot.reshape(-1, s)
    rows = jnp.arange(flat_slot.shape[0])[:, None]
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), flat_slot.shape)
    idx = jnp.zeros((flat_slot.shape[0], k), jnp.int32).at[rows, flat_slot].set(pos, mode="drop")
    idx = idx.reshape(*lead, k)  # the chosen positions in ascending order
    key = ~jnp.take_along_axis(u, idx, axis=-1)  # ascending key = descending value
    _, idx = jax.lax.sort((key, idx), dimension=-1, num_keys=2)  # equal values: lower position first
    return jnp.take_along_axis(x.astype(jnp.float32), idx, axis=-1), idx
