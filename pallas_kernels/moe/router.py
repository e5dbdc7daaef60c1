"""Pallas kernel: an MoE layer's router for decode-sized calls, logits to chosen experts in one launch.

At batch-1 decode XLA ran the router as six small kernels per MoE layer (the [D] x [D, E] product as a
serial reduction, σ + bias, the top-k sort, its slice, the gather of the chosen scores, the renormalisation:
~10 us of a ~1.1 ms Kimi-shaped step per layer, BENCHMARKS.md). One program per token does it all:

    logits = x W (float32 accumulation; the row broadcast to a 16-row tensor-core tile, W streamed in slabs)
    s = σ(logits) or softmax;  k times: e* = argmax(s + bias) (lowest id on ties), take s[e*], mask e*
    w = s_chosen / (Σ s_chosen + 1e-20) · scaling  (renormalised when norm_topk_prob)

One expert group only (n_group = 1, the Kimi-Linear routing); grouped selection stays with the reference.
Generic Pallas: Triton lowering on GPU, interpret mode on CPU (tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._pallas import first_row, pow2, triton_params

MMA_ROWS = 16


def _router_kernel(x_ref, w_ref, b_ref, wt_ref, id_ref, *, k, bk, scoring, norm, scaling):
    kdim, e = w_ref.shape

    def body(i, acc):
        cols = pl.ds(i * bk, bk)
        rows = jnp.broadcast_to(x_ref[cols][None, :], (MMA_ROWS, bk))
        return acc + jnp.dot(rows, w_ref[cols, :], preferred_element_type=jnp.float32,
                             precision=jax.lax.Precision.HIGHEST)  # fmt: skip

    logits = first_row(jax.lax.fori_loop(0, kdim // bk, body, jnp.zeros((MMA_ROWS, e), jnp.float32)))
    if scoring == "sigmoid":
        s = 1.0 / (1.0 + jnp.exp(-logits))
    else:
        z = jnp.exp(logits - jnp.max(logits))
        s = z / jnp.sum(z)
    choice = s + b_ref[...].astype(jnp.float32)
    expert = jax.lax.broadcasted_iota(jnp.int32, (e,), 0)
    slot = jax.lax.broadcasted_iota(jnp.int32, wt_ref.shape, 0)
    ids = jnp.zeros(wt_ref.shape, jnp.int32)
    ws = jnp.zeros(wt_ref.shape, jnp.float32)
    for j in range(k):
        best = jnp.max(choice)
        pick = jnp.min(jnp.where(choice == best, expert, e))  # the lowest id among equal scores
        hit = expert == pick
        ids = jnp.where(slot == j, pick, ids)
        ws = jnp.where(slot == j, jnp.sum(jnp.where(hit, s, 0.0)), ws)
        choice = jnp.where(hit, -jnp.inf, choice)
    if norm:
        ws = ws / (jnp.sum(ws) + 1e-20)  # the padded slots hold zeros
    wt_ref[...] = ws * scaling
    id_ref[...] = ids


def router_block_k(kdim: int) -> int | None:
    """The contraction slab: the largest power of two <= 256 dividing kdim, at least 16; None if none."""
    bk = 256
    while bk >= 16 and kdim % bk:
        bk //= 2
    return bk if bk >= 16 else None


@functools.partial(jax.jit, static_argnames=("k", "scoring", "norm_topk_prob", "scaling", "interpret"))
def route_pallas(x, w, bias, *, k, scoring, norm_topk_prob, scaling, interpret=False):
    """x [N, D], router weight [D, E] (same 2-byte dtype; E a power of two >= 16, D a multiple of 16), bias
    [E] -> (weights [N, k] float32, expert ids [N, k] int32); one program per token."""
    n, d = x.shape
    e = w.shape[1]
    kp = max(pow2(k), 2)
    kernel = functools.partial(
        _router_kernel, k=k, bk=router_block_k(d), scoring=scoring, norm=norm_topk_prob, scaling=scaling
    )
    ws, ids = pl.pallas_call(
        kernel,
        grid=(n,),
        in_specs=[
            pl.BlockSpec((None, d), lambda i: (i, 0)),
            pl.BlockSpec((d, e), lambda i: (0, 0)),
            pl.BlockSpec((e,), lambda i: (0,)),
        ],
        out_specs=[pl.BlockSpec((None, kp), lambda i: (i, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct((n, kp), jnp.float32), jax.ShapeDtypeStruct((n, kp), jnp.int32)],
        interpret=interpret,
        name="moe_router",
        **triton_params(interpret, 4, 3),
    )(x, w, bias.astype(jnp.float32))
    return ws[:, :k], ids[:, :k]
