"""Routed experts of an MoE layer, float32-accumulating jnp: the ground truth.

y_t = Σ_j w_tj E_{idx_tj}(x_t),   E(x) = W_down (SiLU(W_gate x) ⊙ W_up x)

With a SwiGLU limit L (GLM-5.3-Flash's clamped SwiGLU) the float32 products are clamped before they meet:
gate ← min(gate, L), up ← clip(up, −L, L) (`clamp_gate_up`, which every kernel form applies too).
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp

from pallas_kernels._blocking import over_query_blocks
from pallas_kernels.moe.tuning import MAX_EXPANDED_ELEMENTS


def check_swiglu_limit(limit, where: str = "moe_experts", name: str = "swiglu_limit") -> float | None:
    """The SwiGLU limit as a static Python float (None: plain SwiGLU); a ValueError naming the value unless it
    is None or a finite number > 0."""
    if limit is None:
        return None
    # a number, not a bool or a string; not an array either (a traced one cannot be baked into a kernel)
    value = float(limit) if isinstance(limit, numbers.Real) and not isinstance(limit, bool) else math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{where}: {name}={limit!r} must be a finite number > 0, or None (no clamp)")
    return value


def clamp_gate_up(g, u, limit: float | None):
    """The clamped SwiGLU's inputs: (min(g, limit), clip(u, −limit, limit)) — the gate clamped from above only,
    up on both sides; (g, u) unchanged (no op added) for limit None. Used by the reference and inside every
    kernel, on the float32 products, so that all forms clamp alike."""
    if limit is None:
        return g, u
    return jnp.minimum(g, limit), jnp.maximum(jnp.minimum(u, limit), -limit)


def sort_by_expert(idx: jax.Array, num_experts: int):
    """Token-expert pairs grouped by expert: (order [N*k] pair ids sorted by expert, stable; sizes [E])."""
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    return order, jnp.bincount(flat, length=num_experts).astype(jnp.int32)


# MAX_EXPANDED_ELEMENTS (`moe/tuning.py`): elements of the largest operand XLA may build for one block of tokens:
# its `ragged_dot` lowering can form an lhs [rows, E x D] over all experts. Calls above the budget go in token
# blocks of the largest size within it. Why this budget: well below the size that ran out of memory, with blocks
# as large as the shapes measured; measurements in docs/performance.md#moe.


def token_block(n: int, k: int, num_experts: int, width: int, budget: int = MAX_EXPANDED_ELEMENTS) -> int:
    """Tokens per block so that rows x (E x max(D, F)) stays within `budget` (at least one token)."""
    return max(1, min(n, budget // max(1, k * num_experts * width)))


def moe_experts_reference(
    x, idx, w, gate_proj, up_proj, down_proj, *, budget: int = MAX_EXPANDED_ELEMENTS, swiglu_limit: float | None = None
):
    """x [N,D], idx/w [N,k], gate/up [E,D,F], down [E,F,D] -> [N,D] float32. The pairs run as grouped
    matmuls (`lax.ragged_dot`); exact whatever XLA lowers them to. Tokens go in blocks (`lax.map`) when the
    expanded operand of all N tokens would pass `budget` elements; each token's result is unchanged.
    swiglu_limit: the clamped SwiGLU's limit (`clamp_gate_up`), None for plain SwiGLU."""
    n, k = idx.shape
    e, d, f = gate_proj.shape
    limit = check_swiglu_limit(swiglu_limit, "moe_experts_reference")
    block = token_block(n, k, e, max(d, f), budget)
    if block < n:
        blocked = lambda xb, ib, wb: _experts(xb[0], ib[0], wb[0], gate_proj, up_proj, down_proj, limit)[None]  # noqa: E731
        return over_query_blocks(blocked, block, x[None], idx[None], w[None])[0]
    return _experts(x, idx, w, gate_proj, up_proj, down_proj, limit)


def _experts(x, idx, w, gate_proj, up_proj, down_proj, limit=None):
    n, k = idx.shape
    order, sizes = sort_by_expert(idx, gate_proj.shape[0])
    token = order // k
    xs = x[token]  # [N*k, D], grouped by expert
    h_gate = jax.lax.ragged_dot(xs, gate_proj.astype(x.dtype), sizes, preferred_element_type=jnp.float32)
    h_up = jax.lax.ragged_dot(xs, up_proj.astype(x.dtype), sizes, preferred_element_type=jnp.float32)
    h_gate, h_up = clamp_gate_up(h_gate, h_up, limit)
    h = (jax.nn.silu(h_gate) * h_up).astype(x.dtype)
    y = jax.lax.ragged_dot(h, down_proj.astype(x.dtype), sizes, preferred_element_type=jnp.float32)
    y = y * w.reshape(-1)[order][:, None].astype(jnp.float32)
    # each token's k rows gathered back and summed in a fixed order: a scatter-add (`.at[token].add`) adds
    # them in whatever order a GPU's atomics land, so bf16 models decoded differently run to run
    back = jnp.zeros((n * k,), jnp.int32).at[order].set(jnp.arange(n * k, dtype=jnp.int32))  # a permutation
    return jnp.sum(y[back].reshape(n, k, -1), axis=1)


def moe_experts_gather(x, idx, w, gate_proj, up_proj, down_proj, *, swiglu_limit: float | None = None):
    """The same sum with each token-expert pair's weights gathered: x [N,D], idx/w [N,k] -> [N,D] float32.
    Reads (and XLA may copy) k experts' weights per token, so it is for decode-sized N only: it moves
    N*k/E of the experts' bytes where `lax.ragged_dot`'s lowering reads all E experts."""
    limit = check_swiglu_limit(swiglu_limit, "moe_experts_gather")
    dt = x.dtype
    h_gate = jnp.einsum("nd,nkdf->nkf", x, gate_proj[idx].astype(dt), preferred_element_type=jnp.float32)
    h_up = jnp.einsum("nd,nkdf->nkf", x, up_proj[idx].astype(dt), preferred_element_type=jnp.float32)
    h_gate, h_up = clamp_gate_up(h_gate, h_up, limit)
    h = (jax.nn.silu(h_gate) * h_up).astype(dt)
    y = jnp.einsum("nkf,nkfd->nkd", h, down_proj[idx].astype(dt), preferred_element_type=jnp.float32)
    return jnp.einsum("nk,nkd->nd", w.astype(jnp.float32), y)


def route_reference(
    logits, bias, *, k: int, n_group: int = 1, topk_group: int = 1, scoring: str = "sigmoid",
    norm_topk_prob: bool = True, scaling: float = 1.0,
):  # fmt: skip
    """DeepSeek-V3 "noaux_tc" routing: logits [N, E] float32, bias [E] -> (combine weights [N, k] float32,
    expert ids [N, k] int32).

    s = σ(logits) (or softmax); selection uses s + bias, restricted to the `topk_group` groups (of `n_group`)
    whose top-2 biased scores sum highest; weights are the unbiased s of the chosen experts, renormalised
    (+1e-20, as HF) when `norm_topk_prob`, times `scaling`. Ties go to the lower expert id (`lax.top_k`)."""
    s = jax.nn.sigmoid(logits) if scoring == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    choice = s + bias
    if n_group > 1:
        n, e = choice.shape
        grouped = choice.reshape(n, n_group, e // n_group)
        group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [N, G]
        _, keep = jax.lax.top_k(group_score, topk_group)
        keep_mask = jnp.any(jax.nn.one_hot(keep, n_group, dtype=jnp.bool_), axis=1)  # [N, G]
        choice = jnp.where(jnp.repeat(keep_mask, e // n_group, axis=1), choice, -jnp.inf)
    _, idx = jax.lax.top_k(choice, k)
    w = jnp.take_along_axis(s, idx, axis=1)
    if norm_topk_prob:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return w * scaling, idx.astype(jnp.int32)


def router_logits_reference(x, w):
    """x [N, D], router weight [D, E] -> logits [N, E] float32 (the product in float32, as HF's router)."""
    return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def swiglu_reference(x, gate, up, down, *, swiglu_limit: float | None = None):
    """A dense SwiGLU expert as XLA products in x's dtype (float32 accumulation): x [N, D], gate / up [D, F],
    down [F, D] -> [N, D] float32, the output rounded to x's dtype first (what a bf16 SwiGLU layer returns).
    swiglu_limit: clamp the float32 products first (`clamp_gate_up`)."""
    limit = check_swiglu_limit(swiglu_limit, "swiglu_reference")
    dt = x.dtype
    g, u = (jnp.dot(x, a.astype(dt)).astype(jnp.float32) for a in (gate, up))
    g, u = clamp_gate_up(g, u, limit)
    h = (jax.nn.silu(g) * u).astype(dt)
    return jnp.dot(h, down.astype(dt)).astype(jnp.float32)
