"""Pallas kernel: a projection of a few rows (a decode step's tokens) as a weight-streaming split-K GEMV.

With M <= 16 rows the cost of x W [K, N] is reading W once. A grid of (N / BN output tiles) x (S contraction
splits) programs each streams a [K / S, BN] slab of W in BK-row steps and writes a float32 partial; XLA adds
the S partials (fused into whatever consumes the result):

    P_s = x[:, K_s] W[K_s, :]      (grid (N / BN, S)),      y = Σ_s P_s

Each step is one tensor-core product with the rows padded to 16 (the smallest MMA tile; the padding costs
no bytes of W), which also lets Triton stream the W tiles through shared memory with asynchronous copies
`num_stages` deep. A one-row call writes only its row's partials ([S, N], not [S, 16, N]).

A group of projections sharing K runs as one launch (`gemv_group_partials`): the weights' output tiles are
laid end to end along the grid's first axis, each program streams the slab of the weight its tile belongs
to, and the partials come out as one [S, Σ N_i] array (one XLA reduction for all of them); one row is
likewise padded to the MMA tile inside the kernel, not by an XLA pad before it (one launch fewer).

Why: XLA lowers a one-row product to multiply + reduce (the [K, N] products materialised between the two
kernels) and a padded 16-row GEMM launches too few programs to keep every SM streaming; tensor-core steps
beat a CUDA-core kernel (x_k W[k, :] accumulated in registers); and a batch-1 decode step is hundreds of
kernels of a few microseconds each, so every launch saved counts. Measurements in
docs/performance.md#projections.

Generic Pallas: Triton lowering on GPU, interpret mode on CPU (tests). K must divide into S x BK and N into
BN; `api.project` picks the tiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels._pallas import first_row, sum_rows, triton_params

ROWS = 16  # rows of one tensor-core tile: x is padded to it


def _kernel(*refs, n_x, x_of, x_split, bounds, bk, nk, one_row):
    # refs: x_refs [R, K / S] (R = 1 for one row, else 16; [S_x, K / S] float32 partial sums of one row for an
    # input in x_split), w_refs [K / S, BN] (this program's slab of each weight), o_ref [16, BN] ([BN] for one
    # row): the program's output tile of the concatenated widths
    x_refs, w_refs, o_ref = refs[:n_x], refs[n_x:-1], refs[-1]

    def tile(x_ref, w_ref, split):
        def body(kk, acc):
            cols = pl.ds(kk * bk, bk)
            if split:  # the previous projection's partial sums, added here: no XLA reduction between the two
                xs = sum_rows(x_ref, cols)[None, :].astype(w_ref.dtype)
            else:
                xs = x_ref[:, cols]
            if xs.shape[0] != ROWS:  # one row, padded here: an XLA pad would be one more launch per call
                row = jax.lax.broadcasted_iota(jnp.int32, (ROWS, bk), 0)
                xs = jnp.where(row == 0, jnp.broadcast_to(xs, (ROWS, bk)), jnp.zeros((), xs.dtype))
            return acc + jnp.dot(xs, w_ref[cols, :], preferred_element_type=jnp.float32)

        n = w_ref.shape[-1]  # a narrow weight (fewer columns than the tile) fills the start of its tile
        acc = jax.lax.fori_loop(0, nk, body, jnp.zeros((ROWS, n), jnp.float32))
        if one_row:  # row 0 out of the MMA tile
            o_ref[pl.ds(0, n)] = first_row(acc)
        else:
            o_ref[:, pl.ds(0, n)] = acc

    if len(w_refs) == 1:
        tile(x_refs[0], w_refs[0], x_split[0])
        return
    j = pl.program_id(0)
    for i, w_ref in enumerate(w_refs):  # the weight whose output tiles hold tile j (one branch runs)
        x = x_of[i]
        pl.when((j >= bounds[i]) & (j < bounds[i + 1]))(functools.partial(tile, x_refs[x], w_ref, x_split[x]))


def narrow(width: int, block_n: int) -> bool:
    """A weight narrower than the tile that takes one tile of its own (a power of two >= 16 dividing it)."""
    return 16 <= width < block_n and block_n % width == 0 and width & (width - 1) == 0


def tile_starts(widths, block_n: int) -> list[int]:
    """Where each weight's columns start in `gemv_group_partials`'s output: after the earlier weights' whole
    tiles (a narrow weight's tile is padded)."""
    return [int(x) for x in np.cumsum([0, *(-(-n // block_n) * block_n for n in widths[:-1])])]


def _check(name, x_rows, kdim, w, block_n, block_k, split_k):
    if w.shape[0] != kdim or kdim % (split_k * block_k) or (w.shape[1] % block_n and not narrow(w.shape[1], block_n)):
        raise ValueError(
            f"{name}: x has {x_rows} row(s) of K = {kdim}, w {w.shape} must be [K, N] with K a multiple of "
            f"split_k * block_k = {split_k} * {block_k} and N a multiple of block_n = {block_n} (or a power of "
            "two from 16 below it)"
        )


@functools.partial(
    jax.jit,
    static_argnames=("x_of", "x_starts", "block_n", "block_k", "split_k", "interpret", "num_warps", "num_stages"),
)
def gemv_group_partials(
    xs, ws, *, x_of, block_n, block_k, split_k, x_starts=None, interpret=False, num_warps=4, num_stages=3
):  # fmt: skip
    """Several projections of the same K in one launch: xs a tuple of [R, K] inputs (R = 1: one row, padded in
    the kernel; else rows padded to 16, all in w's dtype), ws a tuple of [K, N_i] weights, x_of[i] the input of
    weight i -> partial sums [S, W] float32 ([S, 16, W] for 16 rows), weight i's columns from
    `tile_starts(N, BN)[i]`. The grid is (W / BN output tiles, S splits): each program streams one weight's
    slab. A weight narrower than BN (a power of two from 16: a layer's per-head gate) takes one tile whose
    first N_i columns it fills — it joins the wide weights' launch without shrinking their tiles.

    x_starts (one row only): per input None, or the column where its K columns start in an [S_x, W] float32
    array of another call's partial sums, added in the kernel and rounded to w's dtype (start a multiple of
    K / S) — the previous projection's reduction needs no kernel of its own."""
    x_starts = x_starts or (None,) * len(xs)
    split = tuple(st is not None for st in x_starts)
    if len(x_starts) != len(xs):
        raise ValueError(f"gemv_group_partials: {len(x_starts)} x_starts for {len(xs)} inputs")
    rows = {1 if sp else x.shape[0] for x, sp in zip(xs, split, strict=True)}
    if len(rows) != 1 or rows.pop() not in (1, ROWS) or (any(split) and xs[split.index(True)].ndim != 2):
        raise ValueError(f"gemv_group_partials: inputs {[x.shape for x in xs]} need 1 row each or rows padded to 16")
    if len(x_of) != len(ws) or not set(x_of) <= set(range(len(xs))):
        raise ValueError(f"gemv_group_partials: x_of {x_of} must name one of the {len(xs)} inputs per weight")
    one_row = split[0] or xs[0].shape[0] == 1
    kdim = ws[0].shape[0]
    for x, st in zip(xs, x_starts, strict=True):
        if (x.shape[1] != kdim) if st is None else (st < 0 or st + kdim > x.shape[1]):
            raise ValueError(
                f"gemv_group_partials: every input needs K = {kdim} columns, got {[x.shape for x in xs]} "
                f"(starts {x_starts})"
            )
    for i, w in enumerate(ws):
        _check("gemv_group_partials", 1 if split[x_of[i]] else xs[x_of[i]].shape[0], kdim, w, block_n, block_k,
               split_k)  # fmt: skip
    ks = kdim // split_k
    if any(st is not None and st % ks for st in x_starts):
        raise ValueError(f"gemv_group_partials: partial-sum inputs must start at multiples of K / S = {ks}: {x_starts}")
    tiles = [-(-w.shape[1] // block_n) for w in ws]
    bounds = tuple(int(b) for b in np.cumsum([0, *tiles]))
    width = bounds[-1] * block_n

    def x_spec(x, st):
        if st is None:
            return pl.BlockSpec((x.shape[0], ks), lambda j, s: (0, s))
        return pl.BlockSpec((x.shape[0], ks), lambda j, s, b=st // ks: (0, b + s))

    w_specs = [
        pl.BlockSpec((ks, min(block_n, w.shape[1])), lambda j, s, lo=lo, t=t: (s, jnp.clip(j - lo, 0, t - 1)))
        for w, lo, t in zip(ws, bounds, tiles, strict=False)  # bounds has one more entry
    ]  # fmt: skip
    if one_row:
        out_spec, out_shape = pl.BlockSpec((None, block_n), lambda j, s: (s, j)), (split_k, width)
    else:
        out_spec, out_shape = pl.BlockSpec((None, ROWS, block_n), lambda j, s: (s, 0, j)), (split_k, ROWS, width)
    kernel = functools.partial(_kernel, n_x=len(xs), x_of=x_of, x_split=split, bounds=bounds, bk=block_k,
                               nk=ks // block_k, one_row=one_row)  # fmt: skip
    return pl.pallas_call(
        kernel,
        grid=(bounds[-1], split_k),
        in_specs=[x_spec(x, st) for x, st in zip(xs, x_starts, strict=True)] + w_specs,
        out_specs=out_spec,
        out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        interpret=interpret,
        name="projection_gemv",
        **triton_params(interpret, num_warps, num_stages),
    )(*xs, *ws)
