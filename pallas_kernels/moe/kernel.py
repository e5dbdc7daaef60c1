"""Pallas kernel: grouped matmul over expert-sorted rows padded to whole row blocks (MoE experts).

Rows arrive sorted by expert, each expert's rows padded to a multiple of BM, so every block of BM rows
belongs to one expert (`block_expert`). One program per (row block, BN output columns) reads its expert's
weight tiles straight from W [E, K, N] and accumulates x_block [BM, K] @ W_e [K, BN] over K in BK steps:
work and weight traffic scale with the rows each expert really has (no dense expansion over experts, which
is what XLA makes of `lax.ragged_dot`: E times the FLOPs and an [M, E·K] operand).

`grouped_gate_up_pallas` is the first half of an expert in one pass: it gathers its row block's token rows
from x by id (no expert-sorted copy of x), the gate and up products share each x tile (read once, two
accumulators) and the program writes SiLU(gate) * up in x's dtype — neither float32 product goes to HBM and
comes back. With a SwiGLU limit L (a static float baked into the kernel) it clamps the float32 products first:
gate ← min(gate, L), up ← clip(up, −L, L) (`reference.clamp_gate_up`).

Generic Pallas: Triton lowering on GPU, interpret mode on CPU (tests). K must be a multiple of BK and N of
BN (powers of two); `moe_experts(impl="pallas")` pads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._pallas import triton_params
from pallas_kernels.moe.reference import check_swiglu_limit, clamp_gate_up


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


def _gate_up_kernel(be_ref, tok_ref, x_ref, wg_ref, wu_ref, o_ref, *, bk, nk, precision, swiglu_limit):
    prec = jax.lax.Precision.HIGHEST if precision == "ieee" else jax.lax.Precision.DEFAULT
    e = be_ref[0]

    @pl.when(e >= 0)
    def _():
        toks = tok_ref[...]  # [BM] the block's token rows of x, in expert order

        def body(kk, carry):
            acc_g, acc_u = carry
            xk = x_ref[toks, pl.ds(kk * bk, bk)]  # [BM, BK] gathered, shared by both products
            acc_g += jnp.dot(xk, wg_ref[e, pl.ds(kk * bk, bk), :], precision=prec, preferred_element_type=jnp.float32)
            acc_u += jnp.dot(xk, wu_ref[e, pl.ds(kk * bk, bk), :], precision=prec, preferred_element_type=jnp.float32)
            return acc_g, acc_u

        zero = jnp.zeros(o_ref.shape, jnp.float32)
        g, u = clamp_gate_up(*jax.lax.fori_loop(0, nk, body, (zero, zero)), swiglu_limit)
        o_ref[...] = (g * jax.nn.sigmoid(g) * u).astype(o_ref.dtype)

    @pl.when(e < 0)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


_STATIC = ("block_m", "block_n", "block_k", "precision", "interpret", "num_warps", "num_stages")


def _grouped_call(kernel, name, x, weights, block_expert, out_dtype, *, block_m, block_n, interpret, num_warps,
                  num_stages, row_token=None):  # fmt: skip
    """Grid (row blocks, output tiles): the block's expert id, its rows [block_m, K] and a [E, K, block_n]
    column slab of each weight in; one [block_m, block_n] output tile. With `row_token` [R] the kernel gets
    the block's token ids and all of x [N, K] instead, and gathers the rows itself."""
    kdim = x.shape[1]
    r = x.shape[0] if row_token is None else row_token.shape[0]
    e, _, n = weights[0].shape
    if row_token is None:
        rows_in, rows_args = [pl.BlockSpec((block_m, kdim), lambda i, j: (i, 0))], (x,)
    else:
        rows_in = [pl.BlockSpec((block_m,), lambda i, j: (i,)), pl.BlockSpec(x.shape, lambda i, j: (0, 0))]
        rows_args = (row_token, x)
    return pl.pallas_call(
        kernel,
        grid=(r // block_m, n // block_n),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j: (i,)),
            *rows_in,
            *[pl.BlockSpec((e, kdim, block_n), lambda i, j: (0, 0, j)) for _ in weights],
        ],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((r, n), out_dtype),
        interpret=interpret,
        name=name,
        **triton_params(interpret, num_warps, num_stages),
    )(block_expert, *rows_args, *weights)


@functools.partial(jax.jit, static_argnames=_STATIC + ("swiglu_limit",))
def grouped_gate_up_pallas(
    x, row_token, w_gate, w_up, block_expert, *, block_m, block_n, block_k, precision="tf32", interpret=False,
    num_warps=4, num_stages=2, swiglu_limit=None,
):  # fmt: skip
    """x [N, K] token rows, row_token [R] int32 the token of each expert-sorted row (R a multiple of block_m;
    padding rows name any valid token: computed, never read back), w_gate / w_up [E, K, N'], block_expert
    [R / block_m] int32 (-1 = unused block: zeros) -> SiLU(x_r W_gate) * (x_r W_up) [R, N'] in x.dtype
    (float32 products). The kernel gathers its rows from x: no expert-sorted copy of x is written (why: that
    copy is an XLA gather per MoE layer at prefill; measurements in docs/performance.md#moe).
    swiglu_limit: a static float L: the float32 products clamped first, gate ← min(gate, L), up ← clip(up, ±L)
    (`reference.clamp_gate_up`); None: plain SwiGLU."""
    limit = check_swiglu_limit(swiglu_limit, "grouped_gate_up_pallas")
    kernel = functools.partial(
        _gate_up_kernel, bk=block_k, nk=x.shape[1] // block_k, precision=precision, swiglu_limit=limit
    )
    return _grouped_call(
        kernel, "moe_gate_up", x, (w_gate, w_up), block_expert, x.dtype, row_token=row_token,
        block_m=block_m, block_n=block_n, interpret=interpret, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


@functools.partial(jax.jit, static_argnames=_STATIC + ("out_dtype",))
def grouped_matmul_pallas(
    x, w, block_expert, *, block_m, block_n, block_k, precision="tf32", interpret=False, num_warps=4,
    num_stages=2, out_dtype=jnp.float32,
):  # fmt: skip
    """x [R, K] rows sorted by expert (R a multiple of block_m), w [E, K, N], block_expert [R / block_m]
    int32 (-1 = unused block: zeros, no weight read) -> [R, N] in out_dtype: row block b times
    w[block_expert[b]]."""
    kernel = functools.partial(_kernel, bk=block_k, nk=x.shape[1] // block_k, precision=precision)
    return _grouped_call(
        kernel, "moe_grouped_matmul", x, (w,), block_expert, out_dtype,
        block_m=block_m, block_n=block_n, interpret=interpret, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
