"""Pallas kernels: an MoE layer's router for decode-sized calls, logits to chosen experts in two launches (and,
for an expert count that is not a power of two, a pad of the small [splits, tokens, E] partial sums between).

Why: at batch-1 decode XLA runs the router as six small kernels per MoE layer (the [D] x [D, E] product as a
serial reduction, σ + bias, the top-k sort, its slice, the gather of the chosen scores, the renormalisation);
measurements in docs/performance.md#moe. Here:

1. the logits' partial sums over contraction slabs: the projection op's GEMV kernel (`projection.kernel`,
   its programs spread over the SMs: one program streaming the whole weight is slower);
2. `_select_kernel`, one program (one warp: every reduction stays in registers) per token:
    logits = Σ_s partials_s;  s = σ(logits) or softmax;
    k times: e* = argmax(s + bias) (lowest id on ties), take s[e*], mask e*
    w = s_chosen / (Σ s_chosen + 1e-20) · scaling  (renormalised when norm_topk_prob)

One expert group only (n_group = 1, the Kimi-Linear and GLM-5.3-Flash routing); grouped selection stays with
the reference. E need not be a power of two (GLM-5.3-Flash has 288): the selection program reads the logits
padded to the next power of two with -inf logits and -inf bias, which no selection can pick.
Generic Pallas: Triton lowering on GPU, interpret mode on CPU (tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._pallas import pow2, sum_rows, triton_params
from pallas_kernels.projection.api import auto_split_k, auto_tiles, kernel_rows
from pallas_kernels.projection.kernel import gemv_group_partials


def _select_kernel(parts_ref, b_ref, wt_ref, id_ref, *, k, scoring, norm, scaling):
    e = parts_ref.shape[1]
    logits = sum_rows(parts_ref)  # the GEMV's split partials
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


def router_kernel_shapes(kdim: int, experts: int) -> bool:
    """Whether the kernels take a [kdim, experts] router: 16 <= E <= 1024 and the GEMV's tiles (E and kdim
    multiples of 16)."""
    return 16 <= experts <= 1024 and auto_tiles(kdim, experts) is not None


@functools.partial(jax.jit, static_argnames=("k", "scoring", "norm_topk_prob", "scaling", "interpret"))
def route_pallas(x, w, bias, *, k, scoring, norm_topk_prob, scaling, interpret=False):
    """x [N, D] (N <= 16), router weight [D, E] (same 2-byte dtype, `router_kernel_shapes`), bias [E] ->
    (weights [N, k] float32, expert ids [N, k] int32)."""
    n, d = x.shape
    e = w.shape[1]
    bn, bk = auto_tiles(d, e)
    split = auto_split_k(d, e, bn, bk)
    parts = gemv_group_partials(
        (kernel_rows(x, w.dtype),), (w,), x_of=(0,), block_n=bn, block_k=bk, split_k=split, interpret=interpret
    )
    parts = parts.reshape(split, -1, e)  # [S, 1 or 16 rows, E]
    ep = pow2(e)  # Triton blocks are powers of two: padded experts get -inf logits and bias
    bias = bias.astype(jnp.float32)
    if ep != e:
        parts = jnp.pad(parts, [(0, 0), (0, 0), (0, ep - e)], constant_values=-jnp.inf)
        bias = jnp.pad(bias, [(0, ep - e)], constant_values=-jnp.inf)
    kp = max(pow2(k), 2)
    kernel = functools.partial(_select_kernel, k=k, scoring=scoring, norm=norm_topk_prob, scaling=scaling)
    ws, ids = pl.pallas_call(
        kernel,
        grid=(n,),
        in_specs=[pl.BlockSpec((split, None, ep), lambda i: (0, i, 0)), pl.BlockSpec((ep,), lambda i: (0,))],
        out_specs=[pl.BlockSpec((None, kp), lambda i: (i, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct((n, kp), jnp.float32), jax.ShapeDtypeStruct((n, kp), jnp.int32)],
        interpret=interpret,
        name="moe_router_select",
        **triton_params(interpret, 1, 1),
    )(parts, bias)
    return ws[:, :k], ids[:, :k]
