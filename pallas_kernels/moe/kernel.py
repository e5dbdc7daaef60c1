"""Pallas kernel: grouped matmul over expert-sorted rows padded to whole row blocks (MoE experts).

Rows arrive sorted by expert, each expert's rows padded to a multiple of BM, so every block of BM rows
belongs to one expert (`block_expert`). One program per (row block, BN output columns) reads its expert's
weight tiles straight from W [E, K, N] and accumulates x_block [BM, K] @ W_e [K, BN] over K in BK steps:
work and weight traffic scale with the rows each expert really has (no dense expansion over experts, which
is what XLA makes of `lax.ragged_dot`: E times the FLOPs and an [M, E·K] operand).

Generic Pallas: Triton lowering on GPU, interpret mode on CPU (tests). K must be a multiple of BK and N of
BN (powers of two); `moe_experts(impl="pallas")` pads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._pallas import triton_params


def _kernel(be_ref, x_ref, w_ref, o_ref, *, bk, nk, precision):
    prec = jax.lax.Precision.HIGHEST if precision == "ieee" else jax.lax.Precision.DEFAULT
    e = be_ref[0]  # -1: a block past every expert's rows (the row bound is static, the use is not)

    @pl.when(e >= 0)
    def _():
        def body(kk, acc):
            xk = x_ref[:, pl.ds(kk * bk, bk)]
            wk = w_ref[e, pl.ds(kk * bk, bk), :]
            return acc + jnp.dot(xk, wk, precision=prec, preferred_element_type=jnp.float32)

        acc = jnp.zeros(o_ref.shape, jnp.float32)
        o_ref[...] = jax.lax.fori_loop(0, nk, body, acc).astype(o_ref.dtype)

    @pl.when(e < 0)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


@functools.partial(
    jax.jit, static_argnames=("block_m", "block_n", "block_k", "precision", "interpret", "num_warps", "out_dtype")
)
def grouped_matmul_pallas(
    x, w, block_expert, *, block_m, block_n, block_k, precision="tf32", interpret=False, num_warps=4,
    out_dtype=jnp.float32,
):  # fmt: skip
    """x [R, K] rows sorted by expert (R a multiple of block_m), w [E, K, N], block_expert [R / block_m]
    int32 (-1 = unused block: zeros, no weight read) -> [R, N] in out_dtype: row block b times
    w[block_expert[b]]."""
    r, kdim = x.shape
    e, _, n = w.shape
    kernel = functools.partial(_kernel, bk=block_k, nk=kdim // block_k, precision=precision)
    return pl.pallas_call(
        kernel,
        grid=(r // block_m, n // block_n),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j: (i,)),
            pl.BlockSpec((block_m, kdim), lambda i, j: (i, 0)),
            pl.BlockSpec((e, kdim, block_n), lambda i, j: (0, 0, j)),
        ],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((r, n), out_dtype),
        interpret=interpret,
        name="moe_grouped_matmul",
        **triton_params(interpret, num_warps, 2),
    )(block_expert, x, w)
