"""Pallas kernel: a projection of a few rows (a decode step's tokens) as a weight-streaming split-K GEMV.

With M <= 16 rows the cost of x W [K, N] is reading W once. XLA lowers a one-row product to multiply +
reduce (on the H200 a Kimi KDA layer's q/k/v/o projections, 2304 x 4096 bf16 each, took 15-26 us per
weight in that form, 20-35% of the read floor, with the [K, N] products materialised between the two
kernels) and a padded 16-row GEMM launches too few programs to keep every SM streaming.

Here a grid of (N / BN output tiles) x (S contraction splits) programs each streams a [K / S, BN] slab of W
in BK-row steps through one tensor-core product per step with the rows padded to 16 (the smallest MMA
tile; the padding costs no bytes of W), and writes a float32 partial [16, BN]; XLA adds the S partials
(fused into whatever consumes the result):

    P_s = x[:, K_s] W[K_s, :]      (grid (N / BN, S)),      y = Σ_s P_s

Generic Pallas: Triton lowering on GPU, interpret mode on CPU (tests). K must divide into S x BK and N into
BN; `api.project` picks the tiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._pallas import triton_params

ROWS = 16  # rows of one tensor-core tile: x is padded to it


def _kernel(x_ref, w_ref, o_ref, *, bk, nk):
    # x_ref [16, K / S], w_ref [K / S, BN], o_ref [16, BN]: this program's slab
    def body(kk, acc):
        cols = pl.ds(kk * bk, bk)
        return acc + jnp.dot(x_ref[:, cols], w_ref[cols, :], preferred_element_type=jnp.float32)

    o_ref[...] = jax.lax.fori_loop(0, nk, body, jnp.zeros(o_ref.shape, jnp.float32))


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "split_k", "interpret", "num_warps", "num_stages"))
def gemv_partials(x, w, *, block_n, block_k, split_k, interpret=False, num_warps=4, num_stages=3):
    """x [16, K] (rows padded to 16, w's dtype), w [K, N] -> partial sums [S, 16, N] float32."""
    rows, kdim = x.shape
    width = w.shape[1]
    if rows != ROWS or w.shape[0] != kdim or kdim % (split_k * block_k) or width % block_n:
        raise ValueError(
            f"gemv_partials: x {x.shape} must be [{ROWS}, K] with K = w's rows ({w.shape}), a multiple of "
            f"split_k * block_k = {split_k} * {block_k}, and N a multiple of block_n = {block_n}"
        )
    ks = kdim // split_k
    return pl.pallas_call(
        functools.partial(_kernel, bk=block_k, nk=ks // block_k),
        grid=(width // block_n, split_k),
        in_specs=[
            pl.BlockSpec((ROWS, ks), lambda j, s: (0, s)),
            pl.BlockSpec((ks, block_n), lambda j, s: (s, j)),
        ],
        out_specs=pl.BlockSpec((None, ROWS, block_n), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((split_k, ROWS, width), jnp.float32),
        interpret=interpret,
        name="projection_gemv",
        **triton_params(interpret, num_warps, num_stages),
    )(x, w)
