"""Pallas kernel: causal flash attention over contiguous keys, with the causal rule given by positions.

One program per (batch x KV head, block of BQ query rows). Rows are the queries of one KV head's group
(query t, head g of the group -> row t * G + g), so a prefill (G = 1) and a grouped decode (T = 1, G heads)
both fill the rows. Key s is visible to a row at position p iff s <= p and s < kv_length; a row that sees
nothing gets 0 and LSE -inf (padded rows carry position -1).

The program walks key blocks of BK in two loops, folding each block into a running max / sum / output
(online softmax, float32):
  1. blocks every real row of the block sees whole (below min(kv_length, smallest position + 1)): no mask;
  2. the rest up to min(kv_length, largest position + 1) — a dynamic bound, so a causal prefill reads half
     the keys — masked per element.
Scores are kept in base-2 units (scale * log2(e) folded into one multiply) so the exponentials are exp2,
the hardware's own instruction. The q / k head dim is read as power-of-two pieces (192 = 128 + 64, one
product each) instead of being padded to the next power of two (256: a third more score FLOPs and shared
memory). Query blocks run latest first: the causal prefill's longest programs start first and the short
ones fill the tail.

Generic Pallas: Triton lowering on GPU, interpret mode on CPU (tests). Keys padded to a multiple of BK, the
v head dim to a power of two (`attention(impl="pallas")` pads).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._pallas import triton_params

_NO_ROW = 2**30  # "position" of padded rows when the smallest real position is taken


def head_pieces(h: int) -> tuple[tuple[int, int], ...]:
    """(offset, width) pieces of a head dim padded to a multiple of 16: its binary decomposition, widest
    first, each a power of two >= 16 (a tensor-core product's depth)."""
    hp = -(-h // 16) * 16
    pieces, off = [], 0
    for bit in reversed(range(hp.bit_length())):
        w = 1 << bit
        if hp & w:
            pieces.append((off, w))
            off += w
    return tuple(pieces)


def _kernel(kvlen_ref, pos_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, pieces, scale, block_k, precision):
    prec = jax.lax.Precision.HIGHEST if precision == "ieee" else jax.lax.Precision.DEFAULT
    pos = pos_ref[...]  # [BQ] int32, -1 = padding
    kv_len = kvlen_ref[0]
    bq = pos.shape[0]
    qs = [q_ref[:, pl.ds(off, w)] for off, w in pieces]  # [BQ, w] each
    contract = (((1,), (1,)), ((), ()))
    qk_scale = scale * math.log2(math.e)

    hi = jnp.minimum(kv_len, jnp.max(pos) + 1)  # keys any row of this block may see
    n_blocks = jnp.maximum(hi + block_k - 1, 0) // block_k
    lo = jnp.minimum(kv_len, jnp.min(jnp.where(pos >= 0, pos, _NO_ROW)) + 1)  # keys every real row sees
    n_full = jnp.minimum(jnp.maximum(lo, 0) // block_k, n_blocks)

    def step(j, carry, masked):
        m, l_sum, acc = carry
        s = None
        for qp, (off, w) in zip(qs, pieces, strict=True):
            kp = k_ref[pl.ds(j * block_k, block_k), pl.ds(off, w)]  # [BK, w]
            d = jax.lax.dot_general(qp, kp, contract, precision=prec, preferred_element_type=jnp.float32)
            s = d if s is None else s + d
        s = s * qk_scale  # [BQ, BK], base-2 logits
        if masked:
            key = j * block_k + jax.lax.broadcasted_iota(jnp.int32, (bq, block_k), 1)
            s = jnp.where((key <= pos[:, None]) & (key < kv_len), s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        if masked:  # a row that has seen nothing yet: keep exp2() away from inf - inf
            m_new_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        else:  # every row saw this whole block: m_new is finite
            m_new_safe = m_new
        p = jnp.exp2(s - m_new_safe[:, None])
        alpha = jnp.exp2(m - m_new_safe)
        l_sum = l_sum * alpha + jnp.sum(p, axis=1)
        v = v_ref[pl.ds(j * block_k, block_k), :]  # [BK, Hv]
        pv = jnp.dot(p.astype(v.dtype), v, precision=prec, preferred_element_type=jnp.float32)
        return m_new, l_sum, acc * alpha[:, None] + pv

    carry = (
        jnp.full((bq,), -jnp.inf, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
        jnp.zeros((bq, o_ref.shape[-1]), jnp.float32),
    )
    carry = jax.lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
    m, l_sum, acc = jax.lax.fori_loop(n_full, n_blocks, functools.partial(step, masked=True), carry)
    # padded rows took part in the unmasked blocks; they and rows that saw nothing read as empty
    empty = (l_sum == 0.0) | (pos < 0)
    o_ref[...] = jnp.where(empty[:, None], 0.0, acc / jnp.where(empty, 1.0, l_sum)[:, None]).astype(o_ref.dtype)
    lse = (m + jnp.log2(jnp.where(empty, 1.0, l_sum))) * math.log(2.0)
    lse_ref[...] = jnp.where(empty, -jnp.inf, lse)


@functools.partial(
    jax.jit, static_argnames=("scale", "block_q", "block_k", "precision", "interpret", "num_warps", "num_stages")
)
def flash_attention_pallas(
    q, k, v, positions, kv_lengths, *, scale, block_q, block_k, precision, interpret, num_warps=8, num_stages=2
):  # fmt: skip
    """q [G, R, H] rows of each group (R a multiple of block_q), k [G, S, H] (S a multiple of block_k, H a
    multiple of 16), v [G, S, Hv] (Hv a power of two), positions [G, R] int32 (-1 = padding), kv_lengths
    [G] int32 -> (out [G, R, Hv] in q.dtype, lse [G, R] float32)."""
    g, r, h = q.shape
    s, hv = k.shape[1], v.shape[-1]
    nq = r // block_q
    kernel = functools.partial(_kernel, pieces=head_pieces(h), scale=scale, block_k=block_k, precision=precision)
    rows = lambda i, j: (i, nq - 1 - j)  # latest query block first  # noqa: E731
    return pl.pallas_call(
        kernel,
        grid=(g, nq),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j: (i,)),
            pl.BlockSpec((None, block_q), rows),
            pl.BlockSpec((None, block_q, h), lambda i, j: (*rows(i, j), 0)),
            pl.BlockSpec((None, s, h), lambda i, j: (i, 0, 0)),
            pl.BlockSpec((None, s, hv), lambda i, j: (i, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, block_q, hv), lambda i, j: (*rows(i, j), 0)),
            pl.BlockSpec((None, block_q), rows),
        ],
        out_shape=[jax.ShapeDtypeStruct((g, r, hv), q.dtype), jax.ShapeDtypeStruct((g, r), jnp.float32)],
        interpret=interpret,
        name="flash_attention",
        **triton_params(interpret, num_warps, num_stages),
    )(kv_lengths, positions, q, k, v)
