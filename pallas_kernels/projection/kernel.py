"""Pallas kernel: a projection of a few rows (a decode step's tokens) as a weight-streaming split-K GEMV.

With M <= 16 rows the cost of x W [K, N] is reading W once. XLA lowers a one-row product to multiply +
reduce (on the H200 a Kimi KDA layer's q/k/v/o projections, 2304 x 4096 bf16 each, took 15-26 us per
weight in that form, 20-35% of the read floor, with the [K, N] products materialised between the two
kernels) and a padded 16-row GEMM launches too few programs to keep every SM streaming.

Here a grid of (N / BN output tiles) x (S contraction splits) programs each streams a [K / S, BN] slab of W
in BK-row steps and writes a float32 partial; XLA adds the S partials (fused into whatever consumes the
result):

    P_s = x[:, K_s] W[K_s, :]      (grid (N / BN, S)),      y = Σ_s P_s

Each step is one tensor-core product with the rows padded to 16 (the smallest MMA tile; the padding costs
no bytes of W), which also lets Triton stream the W tiles through shared memory with asynchronous copies
`num_stages` deep. A one-row call writes only its row's partials ([S, N], not [S, 16, N]). On the H200
this kept a Kimi decode step at 1.44 ms where a CUDA-core kernel (x_k W[k, :] accumulated in registers,
62ddcde) took 1.59.

Generic Pallas: Triton lowering on GPU, interpret mode on CPU (tests). K must divide into S x BK and N into
BN; `api.project` picks the tiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._pallas import first_row, triton_params

ROWS = 16  # rows of one tensor-core tile: x is padded to it


def _kernel(x_ref, w_ref, o_ref, *, bk, nk, one_row):
    # x_ref [16, K / S], w_ref [K / S, BN], o_ref [16, BN] ([BN] for one row): this program's slab
    def body(kk, acc):
        cols = pl.ds(kk * bk, bk)
        return acc + jnp.dot(x_ref[:, cols], w_ref[cols, :], preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, nk, body, jnp.zeros((ROWS, w_ref.shape[-1]), jnp.float32))
    if one_row:  # row 0 out of the MMA tile
        acc = first_row(acc)
    o_ref[...] = acc


def _check(name, x_rows, kdim, w, block_n, block_k, split_k):
    if w.shape[0] != kdim or kdim % (split_k * block_k) or w.shape[1] % block_n:
        raise ValueError(
            f"{name}: x has {x_rows} row(s) of K = {kdim}, w {w.shape} must be [K, N] with K a multiple of "
            f"split_k * block_k = {split_k} * {block_k} and N a multiple of block_n = {block_n}"
        )


@functools.partial(
    jax.jit, static_argnames=("block_n", "block_k", "split_k", "one_row", "interpret", "num_warps", "num_stages")
)
def gemv_partials(x, w, *, block_n, block_k, split_k, one_row=False, interpret=False, num_warps=4, num_stages=3):
    """x [16, K] (rows padded to 16, w's dtype), w [K, N] -> partial sums [S, 16, N] float32 ([S, N] with
    one_row: the first row's only)."""
    rows, kdim = x.shape
    width = w.shape[1]
    if rows != ROWS:
        raise ValueError(f"gemv_partials: x {x.shape} must have its rows padded to {ROWS}")
    _check("gemv_partials", 1 if one_row else rows, kdim, w, block_n, block_k, split_k)
    ks = kdim // split_k
    if one_row:
        out_spec, out_shape = pl.BlockSpec((None, block_n), lambda j, s: (s, j)), (split_k, width)
    else:
        out_spec, out_shape = pl.BlockSpec((None, ROWS, block_n), lambda j, s: (s, 0, j)), (split_k, ROWS, width)
    return pl.pallas_call(
        functools.partial(_kernel, bk=block_k, nk=ks // block_k, one_row=one_row),
        grid=(width // block_n, split_k),
        in_specs=[
            pl.BlockSpec((ROWS, ks), lambda j, s: (0, s)),
            pl.BlockSpec((ks, block_n), lambda j, s: (s, j)),
        ],
        out_specs=out_spec,
        out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        interpret=interpret,
        name="projection_gemv",
        **triton_params(interpret, num_warps, num_stages),
    )(x, w)
