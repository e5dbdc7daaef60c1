"""Pallas kernels: MoE experts for decode-sized calls, one program per (token-expert pair, output tile).

At decode sizes a pair's expert sees one row, so the work is a matrix-vector product whose cost is reading
that expert's weights: each program reads its pair's expert id, walks the contraction dimension in BK-row
slabs of W_e [BK, BN] (contiguous along N), and accumulates Σ_k x_k W_e[k, :] in float32 on the CUDA cores
(no tensor-core tile to fill with one row). Nothing is sorted, padded per expert or gathered in HBM: the
weights are read where they lie, k experts per token (two pairs that share an expert read it twice, the
second time mostly from L2).

    h_p = SiLU(x_p W_gate[e_p]) ⊙ (x_p W_up[e_p])      (`gate_up_gemv`, grid (P, F / BF))
    y_p = h_p W_down[e_p]                              (`down_gemv`,    grid (P, D / BD))

Generic Pallas: Triton lowering on GPU, interpret mode on CPU (tests). The contraction length must be a
multiple of BK and the output width of BN (powers of two); `moe_experts(impl="gemv")` pads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._pallas import triton_params


def _gate_up_kernel(e_ref, x_ref, wg_ref, wu_ref, h_ref, *, bk, nk):
    e = e_ref[0]
    bn = h_ref.shape[-1]

    # Partial products accumulate as [BK, BN] tiles and are summed over BK once at the end: a reduction across
    # the tile's rows at every step would cross warps (through shared memory) at every step.
    def body(kk, acc):
        g, u = acc
        xk = x_ref[pl.ds(kk * bk, bk)].astype(jnp.float32)[:, None]  # [BK, 1]
        g = g + xk * wg_ref[e, pl.ds(kk * bk, bk), :].astype(jnp.float32)
        u = u + xk * wu_ref[e, pl.ds(kk * bk, bk), :].astype(jnp.float32)
        return g, u

    zero = jnp.zeros((bk, bn), jnp.float32)
    g, u = jax.lax.fori_loop(0, nk, body, (zero, zero))
    g, u = jnp.sum(g, axis=0), jnp.sum(u, axis=0)
    h_ref[...] = (jax.nn.silu(g) * u).astype(h_ref.dtype)


def _down_kernel(e_ref, h_ref, wd_ref, y_ref, *, bk, nk):
    e = e_ref[0]

    def body(kk, acc):
        hk = h_ref[pl.ds(kk * bk, bk)].astype(jnp.float32)[:, None]
        return acc + hk * wd_ref[e, pl.ds(kk * bk, bk), :].astype(jnp.float32)

    acc = jax.lax.fori_loop(0, nk, body, jnp.zeros((bk, y_ref.shape[-1]), jnp.float32))
    y_ref[...] = jnp.sum(acc, axis=0)


def _pair_call(kernel, name, e_ids, rows, weights, out_width, out_dtype, *, block_n, block_k, interpret, num_warps):
    p, kdim = rows.shape
    n_exp = weights[0].shape[0]
    return pl.pallas_call(
        functools.partial(kernel, bk=block_k, nk=kdim // block_k),
        grid=(p, out_width // block_n),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j: (i,)),
            pl.BlockSpec((None, kdim), lambda i, j: (i, 0)),
            *[pl.BlockSpec((n_exp, kdim, block_n), lambda i, j: (0, 0, j)) for _ in weights],
        ],
        out_specs=pl.BlockSpec((None, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((p, out_width), out_dtype),
        interpret=interpret,
        name=name,
        **triton_params(interpret, num_warps, 2),
    )(e_ids, rows, *weights)


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "interpret", "num_warps"))
def gate_up_gemv(e_ids, x_rows, gate, up, *, block_n, block_k, interpret=False, num_warps=4):
    """e_ids [P] int32, x_rows [P, D] (D a multiple of block_k), gate/up [E, D, F] (F a multiple of block_n)
    -> h [P, F] in x_rows.dtype: SiLU(x_p gate[e_p]) ⊙ (x_p up[e_p])."""
    return _pair_call(
        _gate_up_kernel, "moe_gate_up_gemv", e_ids, x_rows, (gate, up), gate.shape[-1], x_rows.dtype,
        block_n=block_n, block_k=block_k, interpret=interpret, num_warps=num_warps,
    )  # fmt: skip


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "interpret", "num_warps"))
def down_gemv(e_ids, h, down, *, block_n, block_k, interpret=False, num_warps=4):
    """e_ids [P] int32, h [P, F] (F a multiple of block_k), down [E, F, D] (D a multiple of block_n)
    -> y [P, D] float32: h_p down[e_p]."""
    return _pair_call(
        _down_kernel, "moe_down_gemv", e_ids, h, (down,), down.shape[-1], jnp.float32,
        block_n=block_n, block_k=block_k, interpret=interpret, num_warps=num_warps,
    )  # fmt: skip
