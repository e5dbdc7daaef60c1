"""Pallas kernel: causal flash attention over contiguous keys, with the causal rule given by positions.

One program per (batch x KV head, block of BQ query rows). Rows are the queries of one KV head's group
(query t, head g of the group -> row t * G + g), so a prefill (G = 1) and a grouped decode (T = 1, G heads)
both fill the rows. The program walks key blocks of BK from 0 up to min(kv_length, largest row position + 1)
— a dynamic bound, so a causal prefill reads half the keys — scoring q_block @ k_blockᵀ with float32
accumulation and folding the block into a running max / sum / output (online softmax). Key s is visible to
a row at position p iff s <= p and s < kv_length; a row that sees nothing gets 0 and LSE -inf (padded rows
carry position -1).

Generic Pallas: Triton lowering on GPU, interpret mode on CPU (tests). Head dims must be powers of two
(`attention(impl="pallas")` pads), keys padded to a multiple of BK.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._pallas import triton_params


def _kernel(kvlen_ref, pos_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, block_k, precision):
    prec = jax.lax.Precision.HIGHEST if precision == "ieee" else jax.lax.Precision.DEFAULT
    q = q_ref[...]  # [BQ, H]
    pos = pos_ref[...]  # [BQ] int32, -1 = padding
    kv_len = kvlen_ref[0]
    bq = q.shape[0]
    hi = jnp.minimum(kv_len, jnp.max(pos) + 1)  # keys any row of this block may see
    n_blocks = jnp.maximum(hi + block_k - 1, 0) // block_k
    contract = (((1,), (1,)), ((), ()))

    def body(j, carry):
        m, l_sum, acc = carry
        k = k_ref[pl.ds(j * block_k, block_k), :]  # [BK, H]
        v = v_ref[pl.ds(j * block_k, block_k), :]  # [BK, Hv]
        s = jax.lax.dot_general(q, k, contract, precision=prec, preferred_element_type=jnp.float32) * scale
        key = j * block_k + jax.lax.broadcasted_iota(jnp.int32, (bq, block_k), 1)
        visible = (key <= pos[:, None]) & (key < kv_len)
        s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing seen yet: keep exp() away from inf - inf
        p = jnp.exp(s - safe[:, None])
        alpha = jnp.exp(m - safe)
        l_sum = l_sum * alpha + jnp.sum(p, axis=1)
        pv = jnp.dot(p.astype(v.dtype), v, precision=prec, preferred_element_type=jnp.float32)
        return m_new, l_sum, acc * alpha[:, None] + pv

    init = (
        jnp.full((bq,), -jnp.inf, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
        jnp.zeros((bq, o_ref.shape[-1]), jnp.float32),
    )
    m, l_sum, acc = jax.lax.fori_loop(0, n_blocks, body, init)
    empty = l_sum == 0.0
    o_ref[...] = jnp.where(empty[:, None], 0.0, acc / jnp.where(empty, 1.0, l_sum)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l_sum)))


@functools.partial(
    jax.jit, static_argnames=("scale", "block_q", "block_k", "precision", "interpret", "num_warps", "num_stages")
)
def flash_attention_pallas(
    q, k, v, positions, kv_lengths, *, scale, block_q, block_k, precision, interpret, num_warps=4, num_stages=2
):  # fmt: skip
    """q [G, R, H] rows of each group (R a multiple of block_q), k [G, S, H], v [G, S, Hv] (S a multiple of
    block_k), positions [G, R] int32 (-1 = padding), kv_lengths [G] int32 -> (out [G, R, Hv] in q.dtype,
    lse [G, R] float32). H and Hv powers of two."""
    g, r, h = q.shape
    s, hv = k.shape[1], v.shape[-1]
    kernel = functools.partial(_kernel, scale=scale, block_k=block_k, precision=precision)
    return pl.pallas_call(
        kernel,
        grid=(g, r // block_q),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j: (i,)),
            pl.BlockSpec((None, block_q), lambda i, j: (i, j)),
            pl.BlockSpec((None, block_q, h), lambda i, j: (i, j, 0)),
            pl.BlockSpec((None, s, h), lambda i, j: (i, 0, 0)),
            pl.BlockSpec((None, s, hv), lambda i, j: (i, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, block_q, hv), lambda i, j: (i, j, 0)),
            pl.BlockSpec((None, block_q), lambda i, j: (i, j)),
        ],
        out_shape=[jax.ShapeDtypeStruct((g, r, hv), q.dtype), jax.ShapeDtypeStruct((g, r), jnp.float32)],
        interpret=interpret,
        name="flash_attention",
        **triton_params(interpret, num_warps, num_stages),
    )(kv_lengths, positions, q, k, v)
