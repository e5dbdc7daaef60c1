"""Helpers shared by the jnp references: bounded-memory query blocking and a NaN-free masked softmax."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Elements of the largest per-block intermediate (e.g. [B, T_block, N, S] logits) the references allow
# themselves: 2^27 float32 values = 512 MiB, so long prefills run without materialising [T, S] at once.
BLOCK_ELEMENTS = 1 << 27


def query_block_size(t: int, elements_per_query: int) -> int:
    return max(1, min(t, BLOCK_ELEMENTS // max(1, elements_per_query)))


def dividing_block(t: int, block: int, align: int = 1) -> int:
    """A block size for `over_query_blocks` of at most `block` that divides `t` (so the queries are not
    padded: a padded copy of a prefill's inputs costs a pass over them) — the largest multiple of `align`
    that does, if it is at least half of `block`; else `block` itself."""
    if t <= block:
        return block
    for size in range(block // align * align, block // 2 - 1, -align):
        if size > 0 and t % size == 0:
            return size
    return block


def over_query_blocks(fn, block: int, *xs):
    """fn(*xs) where every x has the query axis at position 1, evaluated `block` queries at a time
    (`lax.map`); outputs (any pytree of arrays with the query axis at 1) are stitched back together."""
    t = xs[0].shape[1]
    if t <= block:
        return fn(*xs)
    nb = -(-t // block)
    pad = nb * block - t

    def split(x):
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(x.shape[0], nb, block, *x.shape[2:]), 1, 0)

    out = jax.lax.map(lambda args: fn(*args), tuple(split(x) for x in xs))

    def join(y):
        y = jnp.moveaxis(y, 0, 1)
        return y.reshape(y.shape[0], nb * block, *y.shape[3:])[:, :t]

    return jax.tree_util.tree_map(join, out)


def masked_softmax(logits: jax.Array, visible: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Softmax over the last axis restricted to `visible`; rows with nothing visible give p = 0 and
    lse = -inf instead of NaN. Returns (p, natural-log LSE without the last axis)."""
    logits = jnp.where(visible, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(logits - m_safe)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(denom > 0, denom, 1.0)
    return p, (jnp.log(denom) + m_safe)[..., 0]
