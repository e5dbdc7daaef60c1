"""Pallas kernels: MoE experts for calls of a few tokens, one program per (touched expert, output tile, split).

From two tokens on, a call's token-expert pairs share experts: the per-pair GEMV kernels (`gemv.py`) read an
expert's weights once per pair, and `lax.ragged_dot` reads every expert's weights whatever the call touches. Here
the pairs are grouped by expert first (in XLA: comparisons among the P = N·k expert ids). Group g holds the rows
of the tokens routed to expert e_g — at most N <= 16, one per token, since a token routes to an expert at most
once — as a [16] table of token rows, padded with a zero row; the gate / up kernel gathers the [16, BK] rows
itself (no [G, 16, D] copy in between). Each program reads its slab of W[e_g] once and multiplies all 16 rows
by it in one tensor-core product: the [16, BK] x [BK, BN] step that the per-pair kernels take with one row
broadcast to 16 rows. So a call reads each touched expert's weights once.

    Gate_g = X_g W_gate[e_g],  Up_g = X_g W_up[e_g]    (`gate_up_expert_gemv`, grid (G, F / BF, S): partial sums)
    h_g = SiLU(Σ_s Gate_g) ⊙ Σ_s Up_g                  (XLA, in the activations' dtype)
    Y_g = h_g W_down[e_g]                              (`down_expert_gemv`,    grid (G, D / BD, S'))

The contraction is split S ways as in `gemv.py` (enough programs for a call that touches few experts). XLA
adds the gate / up partial sums and forms h in the activations' dtype between the two launches (after the
SwiGLU limit's clamp when there is one): one small fusion, where forming it in the down kernel read 2 S
float32 [16, BK] slabs a step beside a [BK, BN] weight slab (1.4-1.6x slower, docs/performance.md). G = min(P, E)
groups is static; groups past the experts a call touches carry expert id −1, and their programs write zeros
without reading any weight. The shared expert is one more group holding every token's row, run through the
shared weights in the same launches.

Precondition (what top-k routing gives): a token's k expert ids are distinct and in [0, E). Repeated ids could
put more than 16 rows in a group and ids outside the range name no expert; neither is checked (the ids are
traced values), and both give wrong sums.

Generic Pallas: Triton lowering on GPU, interpret mode on CPU (tests). Contractions must be multiples of
S x BK and output widths of BN (powers of two); `moe_experts(impl="pallas", form="expert_gemv")` pads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._pallas import triton_params
from pallas_kernels.moe.gemv import check_slabs

GROUP_ROWS = 16  # rows of one tensor-core tile: a group's tokens, zero-padded; also the most tokens a call has


def _per_group(e_ref, routed, shared, n_routed, run, zero):
    """run(weights) with group g's expert slabs (g < n_routed, expert id >= 0), with the shared expert's
    (g >= n_routed), or zero() for a group past the touched experts (expert id −1: no weight read)."""
    e = e_ref[0]
    g = pl.program_id(0)
    routed_group = g < n_routed if shared else True
    pl.when(jnp.logical_and(routed_group, e >= 0))(lambda: run([lambda c, r=r: r[e, c, :] for r in routed]))
    pl.when(jnp.logical_and(routed_group, e < 0))(zero)
    if shared:
        pl.when(g >= n_routed)(lambda: run([lambda c, r=r: r[c, :] for r in shared]))


def _dot(a, b, precision):
    prec = jax.lax.Precision.HIGHEST if precision == "ieee" else jax.lax.Precision.DEFAULT
    return jnp.dot(a, b, precision=prec, preferred_element_type=jnp.float32)


def _gate_up_kernel(e_ref, t_ref, x_ref, wg_ref, wu_ref, *refs, bk, nk, n_routed, precision):
    *shared, g_ref, u_ref = refs
    tokens = t_ref[...]  # [16]: the group's rows of x (a zero row where the group has no token)

    def run(w):
        def body(kk, acc):
            cols = pl.ds(kk * bk, bk)
            xk = x_ref[tokens, cols]  # [16, BK]: the group's rows, read once for both products
            return acc[0] + _dot(xk, w[0](cols), precision), acc[1] + _dot(xk, w[1](cols), precision)

        zero = jnp.zeros(g_ref.shape, jnp.float32)
        g, u = jax.lax.fori_loop(0, nk, body, (zero, zero))
        g_ref[...] = g
        u_ref[...] = u

    def zero():
        g_ref[...] = jnp.zeros(g_ref.shape, jnp.float32)
        u_ref[...] = jnp.zeros(u_ref.shape, jnp.float32)

    _per_group(e_ref, (wg_ref, wu_ref), shared, n_routed, run, zero)


def _down_kernel(e_ref, h_ref, wd_ref, *refs, bk, nk, n_routed, precision):
    *shared, y_ref = refs

    def run(w):
        def body(kk, acc):
            cols = pl.ds(kk * bk, bk)
            return acc + _dot(h_ref[:, cols], w[0](cols), precision)

        y_ref[...] = jax.lax.fori_loop(0, nk, body, jnp.zeros(y_ref.shape, jnp.float32))

    def zero():
        y_ref[...] = jnp.zeros(y_ref.shape, jnp.float32)

    _per_group(e_ref, (wd_ref,), shared, n_routed, run, zero)


def _group_call(kernel, name, e_ids, rows, weights, n_out, *, block_n, block_k, split_k, shared, interpret,
                num_warps, num_stages, row_token=None):  # fmt: skip
    """Grid (groups, output tiles, contraction splits) -> n_out float32 partial sums [G, split_k, 16, N].
    e_ids [G_routed] (G_routed <= G; the groups after them run the `shared` weights [K, N]); program (g, j, s)
    reads group g's slab s of rows [G, 16, K], or with row_token [G, 16] (the rows of each group) of rows
    [R, K], the kernel gathering the group's rows itself."""
    n_routed = e_ids.shape[0]
    if row_token is None:
        g_all, rows_per_group, kdim = rows.shape
    else:
        (g_all, rows_per_group), kdim = row_token.shape, rows.shape[-1]
        if rows.ndim != 2 or rows.shape[0] <= GROUP_ROWS:
            raise ValueError(f"{name}: rows {rows.shape} must be [R > {GROUP_ROWS}, K] (a zero row past the tokens)")
    if rows_per_group != GROUP_ROWS:
        raise ValueError(f"{name}: {rows.shape if row_token is None else row_token.shape} groups of "
                         f"{rows_per_group} rows; a group holds {GROUP_ROWS}")  # fmt: skip
    if (g_all > n_routed) != bool(shared) or g_all < n_routed:
        raise ValueError(f"{name}: {g_all} row groups for {n_routed} expert ids and {len(shared)} shared weights")
    n_exp, width = check_slabs(name, weights, kdim, split_k, block_k, block_n, shared)
    ks = kdim // split_k

    if row_token is None:
        row_specs = [pl.BlockSpec((None, GROUP_ROWS, ks), lambda i, j, s: (i, 0, s))]
        row_args = (rows,)
    else:
        row_specs = [
            pl.BlockSpec((None, GROUP_ROWS), lambda i, j, s: (i, 0)),
            pl.BlockSpec((rows.shape[0], ks), lambda i, j, s: (0, s)),
        ]
        row_args = (row_token, rows)
    out = jax.ShapeDtypeStruct((g_all, split_k, GROUP_ROWS, width), jnp.float32)
    return pl.pallas_call(
        functools.partial(kernel, bk=block_k, nk=ks // block_k, n_routed=n_routed),
        grid=(g_all, width // block_n, split_k),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j, s: (jnp.minimum(i, n_routed - 1),)),
            *row_specs,
            *[pl.BlockSpec((n_exp, ks, block_n), lambda i, j, s: (0, s, j)) for _ in weights],
            *[pl.BlockSpec((ks, block_n), lambda i, j, s: (s, j)) for _ in shared],
        ],
        out_specs=[pl.BlockSpec((None, None, GROUP_ROWS, block_n), lambda i, j, s: (i, s, 0, j))] * n_out,
        out_shape=[out] * n_out,
        interpret=interpret,
        name=name,
        **triton_params(interpret, num_warps, num_stages),
    )(e_ids, *row_args, *weights, *shared)


_STATIC = ("block_n", "block_k", "split_k", "precision", "interpret", "num_warps", "num_stages")


@functools.partial(jax.jit, static_argnames=_STATIC)
def gate_up_expert_gemv(
    e_ids, row_token, rows, gate, up, *, block_n, block_k, split_k=1, precision="tf32", interpret=False,
    num_warps=4, num_stages=3, shared=None,
):  # fmt: skip
    """e_ids [G] int32 (−1: no group), row_token [G (+1), 16] int32 each group's rows of `rows` [R, D] (R > 16;
    empty group rows name a zero row; D a multiple of split_k * block_k; the kernel gathers them), gate /
    up [E, D, F] (F a multiple of block_n) -> (gate, up) partial sums [G (+1), split_k, 16, F] float32: X_g
    gate[e_g] and X_g up[e_g] per contraction slab, X_g = rows[row_token[g]]. shared: the shared expert's
    (gate, up) [D, F], run on the last group. precision "ieee": exact float32 products (float32 operands), else
    the tensor cores' default."""
    kernel = functools.partial(_gate_up_kernel, precision=precision)
    g, u = _group_call(
        kernel, "moe_gate_up_expert_gemv", e_ids, rows, (gate, up), 2, block_n=block_n, block_k=block_k,
        split_k=split_k, shared=tuple(shared or ()), interpret=interpret, num_warps=num_warps,
        num_stages=num_stages, row_token=row_token.astype(jnp.int32),
    )  # fmt: skip
    return g, u


@functools.partial(jax.jit, static_argnames=_STATIC)
def down_expert_gemv(
    e_ids, h, down, *, block_n, block_k, split_k=1, precision="tf32", interpret=False, num_warps=4, num_stages=3,
    shared=None,
):  # fmt: skip
    """e_ids [G], h [G (+1), 16, F] each group's SiLU(gate) ⊙ up (F a multiple of split_k * block_k), down
    [E, F, D] (D a multiple of block_n) -> Y [G (+1), 16, D] float32: h_g down[e_g]. shared: the shared
    expert's down [F, D] for the last group."""
    (y,) = _group_call(
        functools.partial(_down_kernel, precision=precision), "moe_down_expert_gemv", e_ids, h, (down,), 1,
        block_n=block_n, block_k=block_k, split_k=split_k, shared=tuple(shared or ()), interpret=interpret,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return jnp.sum(y, axis=1)


def group_by_expert(idx, num_experts: int):
    """A call's pairs grouped by expert, for `gate_up_expert_gemv`: idx [N, k] (N <= 16) ->
    (e_ids [G] int32 the expert of each group, −1 past the touched ones; row_token [G, 16] int32 the token of
    each group row, N for an empty row; pair_at [N, k] int32 the flat index g * 16 + row of each pair's row).
    G = min(N·k, E). Groups follow expert ids in ascending order; a group's rows follow its tokens in order.
    Each token's ids must be distinct and in [0, E) (the module's precondition)."""
    n, k = idx.shape
    if n > GROUP_ROWS:
        raise ValueError(f"group_by_expert: {n} tokens > {GROUP_ROWS} (a group's rows are one 16-row tile)")
    p = n * k
    groups = min(p, num_experts)
    flat = idx.reshape(-1).astype(jnp.int32)  # pair p = token p // k: flat order is token-major
    # All-pairs comparisons of the P <= 16·k ids instead of a sort, cumsum, search and scatters: fewer, fused
    # launches in each MoE layer of a verify step (docs/performance.md, "Speculative decoding").
    i = jnp.arange(p, dtype=jnp.int32)
    same = flat[:, None] == flat[None, :]  # [P, P]
    before = same & (i[None, :] < i[:, None])  # pair q (column) is an earlier pair of p's expert
    row = jnp.sum(before, axis=1, dtype=jnp.int32)  # earlier pairs of the same expert: rows in token order
    first = row == 0  # the first pair of its expert
    # the group of a pair: the touched experts with smaller ids (groups in ascending expert order)
    group = jnp.sum(first[None, :] & (flat[None, :] < flat[:, None]), axis=1, dtype=jnp.int32)
    hit = group[None, :] == jnp.arange(groups, dtype=jnp.int32)[:, None]  # [G, P]
    e_ids = jnp.max(jnp.where(hit, flat[None, :], -1), axis=1)
    at = hit[:, None, :] & (row[None, None, :] == jnp.arange(GROUP_ROWS, dtype=jnp.int32)[None, :, None])
    row_token = jnp.min(jnp.where(at, (i // k)[None, None, :], n), axis=2)  # [G, 16]: one pair at most, or N
    return e_ids, row_token, (group * GROUP_ROWS + row).reshape(n, k)
