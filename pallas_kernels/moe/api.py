"""Public entry point of an MoE layer's routed experts."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import registry
from pallas_kernels._pallas import pow2
from pallas_kernels.moe.expert_gemv import GROUP_ROWS, down_expert_gemv, gate_up_expert_gemv, group_by_expert
from pallas_kernels.moe.gemv import auto_split_k, down_gemv, gate_up_gemv
from pallas_kernels.moe.kernel import grouped_gate_up_pallas, grouped_matmul_pallas
from pallas_kernels.moe.reference import (
    check_swiglu_limit,
    clamp_gate_up,
    moe_experts_gather,
    moe_experts_reference,
    route_reference,
    router_logits_reference,
    sort_by_expert,
    swiglu_reference,
)
from pallas_kernels.moe.router import route_pallas, router_kernel_shapes
from pallas_kernels.moe.tuning import (
    DECODE_BLOCK_M,
    DECODE_TILES,
    GEMV_DOWN_TILES,
    GEMV_TILES,
    GROUPED_TILES,
    PREFILL_TILES,
    ROUTER_MAX_ROWS,
    SMALL_CALL_PAIRS,
    WIDE_OPERAND_MAX_STAGES,
)

# The algorithms `form=` names inside each impl.
FORMS = {"reference": ("ragged_dot", "gather"), "pallas": ("grouped", "gemv", "expert_gemv")}


def auto_block_m(pairs: int, experts: int) -> int:
    """The grouped kernel's row block when none is given (`tuning.DECODE_BLOCK_M` for small calls)."""
    small = pairs < max(SMALL_CALL_PAIRS, DECODE_BLOCK_M * experts)
    return DECODE_BLOCK_M if small else PREFILL_TILES["block_m"]


def _pad_weights(a, rows: int, cols: int, dtype):
    """[E, r, c] -> [E, rows, cols] in dtype, zero-padded (whole kernel tiles; zeros add nothing)."""
    return jnp.pad(a.astype(dtype), [(0, 0), (0, rows - a.shape[1]), (0, cols - a.shape[2])])


def _tile(dim: int, cap: int) -> tuple[int, int]:
    """(tile, padded dim): a power-of-two tile <= cap and dim padded to a multiple of it."""
    t = min(cap, pow2(dim))
    return t, -(-dim // t) * t


def moe_experts(
    x,
    idx,
    w,
    gate_proj,
    up_proj,
    down_proj,
    *,
    impl: str = "auto",
    form: str | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    precision: str = "tf32",
    interpret: bool | None = None,
    shared=None,
    swiglu_limit: float | None = None,
):
    """Σ_j w_tj E_{idx_tj}(x_t) with E(x) = W_down(SiLU(W_gate x) ⊙ W_up x) [+ the shared expert S(x)].

    x [N,D]; idx [N,k] int expert ids; w [N,k] weights; gate/up [E,D,F]; down [E,F,D] -> [N,D] float32.
    impl / form (see `pallas_kernels.registry`):
    - "reference": form "ragged_dot" (`lax.ragged_dot` grouped matmuls, the default) or "gather" (jnp with
      each pair's expert weights gathered: decode-sized calls only; `reference.moe_experts_gather`);
    - "pallas": form "grouped" (the default; `kernel.grouped_matmul_pallas` on rows sorted by expert and padded
      per expert to whole blocks of `block_m` rows — default `auto_block_m` —, gate and up in one kernel
      writing SiLU(gate) ⊙ up, then down) or "gemv" (`gemv.gate_up_gemv` and `gemv.down_gemv`: one program
      per token-expert pair, output tile and contraction split, reading the pair's expert weights in place —
      decode-sized calls; `split_k` a power of two, default `gemv.auto_split_k`) or "expert_gemv"
      (`expert_gemv`: the pairs grouped by expert, one program per touched expert, output tile and split,
      each reading its expert's weights once for all of the call's rows routed to it — calls of at most
      `expert_gemv.GROUP_ROWS` tokens, such as a speculative verify block; tiles and `split_k` as "gemv";
      each token's expert ids distinct and in [0, E), as top-k routing gives);
    - "auto": `registry.resolve("moe", ...)`.
    Tiles: `block_n` / `block_k` output and contraction tiles, powers of two (defaults `tuning.GROUPED_TILES`
    / `tuning.GEMV_TILES`, and for "gemv"'s down kernel `tuning.GEMV_DOWN_TILES`; a tile given applies to every
    kernel); `num_warps` / `num_stages` Triton's parameters of the grouped kernels (defaults
    by row block: `tuning.DECODE_TILES` for small blocks, else `tuning.PREFILL_TILES`, at most
    `WIDE_OPERAND_MAX_STAGES` stages for float32 operands).
    shared: the shared expert's (gate [D, Fs], up [D, Fs], down [Fs, D]), added as S(x) rounded to x's dtype
    (what a separate SwiGLU of bf16 projections returns). With "gemv" or "expert_gemv" and Fs = F it runs in
    the routed experts' two launches (one more program row per token, or one more group of every token's row:
    its four projection kernels and their epilogues saved at every decode step); otherwise as XLA products
    (`swiglu_reference`).
    swiglu_limit: the clamped SwiGLU (GLM-5.3-Flash) of every expert, the shared one included: with L, gate ←
    min(gate, L) and up ← clip(up, −L, L) on the float32 products before SiLU(gate) ⊙ up
    (`reference.clamp_gate_up`, applied alike by every impl and form; a static float baked into the kernels,
    or applied by XLA where "expert_gemv" forms h between its launches).
    None (the default): plain SwiGLU, the same program as without the argument. A ValueError unless None or a
    finite number > 0.
    """
    registry.check_impl("moe", impl)
    limit = check_swiglu_limit(swiglu_limit)
    n, d = x.shape
    e, d2, f = gate_proj.shape
    if idx.shape != w.shape or idx.shape[0] != n or d2 != d or up_proj.shape != gate_proj.shape:
        raise ValueError(
            f"moe_experts: inconsistent shapes x={x.shape} idx={idx.shape} w={w.shape} gate={gate_proj.shape}"
        )
    if down_proj.shape != (e, f, d):
        raise ValueError(f"moe_experts: down_proj.shape={down_proj.shape} != {(e, f, d)}")
    if block_m is None:
        block_m = auto_block_m(idx.size, e)
    triton = DECODE_TILES if block_m <= DECODE_BLOCK_M else PREFILL_TILES
    if num_stages is None:
        num_stages = triton["num_stages"]
        if max(jnp.dtype(x.dtype).itemsize, jnp.dtype(gate_proj.dtype).itemsize) >= 4:
            num_stages = min(num_stages, WIDE_OPERAND_MAX_STAGES)
    num_warps = num_warps or triton["num_warps"]
    if impl == "auto":  # before the tile defaults, which depend on the kernel
        choice = registry.resolve("moe", impl, pairs=idx.size, experts=e, tokens=n)
        impl, form = choice.impl, form or choice.form
    form = form or FORMS[impl][0]
    if form not in FORMS[impl]:
        raise ValueError(f"moe_experts: form={form!r} is not one of impl={impl!r}'s {FORMS[impl]}")
    if form == "expert_gemv" and n > GROUP_ROWS:
        raise ValueError(f"moe_experts: form='expert_gemv' takes at most {GROUP_ROWS} tokens (got {n})")
    tiles = GEMV_TILES if form in ("gemv", "expert_gemv") else GROUPED_TILES
    # the per-pair down kernel's own defaults; a tile given by the caller applies to both kernels
    down_tiles = tuple(t if v is None else v for t, v in zip(GEMV_DOWN_TILES, (block_n, block_k), strict=True))
    given = dict(block_n=block_n, block_k=block_k)  # as the caller gave them (None: each kernel's default)
    block_n = tiles[0] if block_n is None else block_n
    block_k = tiles[1] if block_k is None else block_k
    for name, v in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"moe_experts: {name}={v} must be a power of two >= 16")
    if split_k is not None and (split_k < 1 or split_k & (split_k - 1)):
        raise ValueError(f"moe_experts: split_k={split_k} must be a power of two >= 1")
    if shared is not None and (
        len(shared) != 3
        or shared[0].shape != (d, shared[0].shape[1])
        or shared[1].shape != shared[0].shape
        or shared[2].shape != shared[0].shape[::-1]
    ):
        raise ValueError(f"moe_experts: shared expert weights {[a.shape for a in shared]} must be [D, Fs] x2, [Fs, D]")
    interpret = registry.interpret_default(interpret)
    experts_gemv = {
        "gemv": functools.partial(_experts_gemv, down_tiles=down_tiles), "expert_gemv": _experts_expert_gemv
    }.get(form)  # fmt: skip
    if experts_gemv and shared is not None and shared[0].shape[1] == f:  # the shared expert in the same launches
        return experts_gemv(
            x, idx, w, gate_proj, up_proj, down_proj, block_n, block_k, split_k, interpret, shared, limit=limit
        )
    if shared is not None:
        return moe_experts(
            x, idx, w, gate_proj, up_proj, down_proj, impl=impl, form=form, block_m=block_m, **given,
            split_k=split_k, num_warps=num_warps, num_stages=num_stages, precision=precision, interpret=interpret,
            swiglu_limit=limit,
        ) + swiglu_reference(x, *shared, swiglu_limit=limit)  # fmt: skip
    if form == "ragged_dot":
        return moe_experts_reference(x, idx, w, gate_proj, up_proj, down_proj, swiglu_limit=limit)
    if form == "gather":
        return moe_experts_gather(x, idx, w, gate_proj, up_proj, down_proj, swiglu_limit=limit)
    if experts_gemv:
        return experts_gemv(x, idx, w, gate_proj, up_proj, down_proj, block_n, block_k, split_k, interpret, limit=limit)

    k = idx.shape[1]
    order, sizes = sort_by_expert(idx, e)
    # Each expert's rows padded to whole blocks: static bound N*k + E*(block_m - 1) rows in all.
    padded = -(-sizes // block_m) * block_m
    start = jnp.cumsum(padded) - padded  # first padded row of each expert
    unpadded_start = jnp.cumsum(sizes) - sizes
    flat_sorted = idx.reshape(-1)[order]
    rank = jnp.arange(n * k) - unpadded_start[flat_sorted]
    dest = start[flat_sorted] + rank  # padded row of each sorted pair
    rows = -(-(n * k + e * (block_m - 1)) // block_m) * block_m
    nb = rows // block_m
    ends = jnp.cumsum(padded)
    # compare_all: one fused kernel. The default binary search is a while loop, which on a GPU launches a few
    # kernels and copies the loop predicate to the host at every iteration.
    block_expert = jnp.searchsorted(ends, jnp.arange(nb) * block_m, side="right", method="compare_all")
    block_expert = jnp.where(block_expert < e, block_expert, -1).astype(jnp.int32)  # -1: past all rows

    bk_d, d_pad = _tile(d, block_k)
    bn_f, f_pad = _tile(f, block_n)
    bk_f, f_pad2 = _tile(f_pad, block_k)
    bn_d, d_pad2 = _tile(d_pad, block_n)
    d_pad, f_pad = max(d_pad, d_pad2), max(f_pad, f_pad2)
    token = order // k
    # The token of each sorted, padded row (the gate/up kernel gathers them); padding rows read token 0:
    # computed, never read back.
    row_token = jnp.zeros((rows,), jnp.int32).at[dest].set(token.astype(jnp.int32))
    xp = jnp.pad(x, [(0, 0), (0, d_pad - d)])
    kw = dict(block_m=block_m, precision=precision, interpret=interpret, num_warps=num_warps, num_stages=num_stages)
    pad3 = lambda a, p1, p2: _pad_weights(a, p1, p2, x.dtype)  # noqa: E731
    gate, up = pad3(gate_proj, d_pad, f_pad), pad3(up_proj, d_pad, f_pad)
    h = grouped_gate_up_pallas(
        xp, row_token, gate, up, block_expert, block_n=bn_f, block_k=bk_d, swiglu_limit=limit, **kw
    )
    # each pair's output in x's dtype (as the reference model's per-expert products), summed in float32
    y = grouped_matmul_pallas(
        h, pad3(down_proj, f_pad, d_pad), block_expert, block_n=bn_d, block_k=bk_f, out_dtype=x.dtype, **kw
    )
    # Each token's k rows gathered back and summed in a fixed order (a scatter-add would add them in
    # whatever order the atomics land: not deterministic run to run).
    sorted_at = jnp.zeros((n * k,), jnp.int32).at[order].set(jnp.arange(n * k, dtype=jnp.int32))
    # The row of each pair, computed once: fused into the gather below, XLA recomputed its cumsums and gathers
    # for every output element (docs/performance.md, "Prefix caching")
    src = jax.lax.optimization_barrier(dest[sorted_at])
    y = y[src, :d].reshape(n, k, d)  # [N, k, D], pair (t, j) at [t, j]
    return jnp.einsum("nk,nkd->nd", w.astype(jnp.float32), y, precision=jax.lax.Precision.HIGHEST)


def _experts_gemv(x, idx, w, gate_proj, up_proj, down_proj, block_n, block_k, split_k, interpret, shared=None,
                  mma=True, limit=None, down_tiles=None):  # fmt: skip
    """form="gemv": every token-expert pair through the per-pair kernels, then the weighted sum over k; the
    shared expert's (gate, up, down) as one more program row per token in the same launches. limit: the
    SwiGLU limit, applied where the down kernels form h (routed pairs and shared rows alike). (block_n,
    block_k) tile gate/up, down_tiles (default the same) the down kernel."""
    n, d = x.shape
    k = idx.shape[1]
    f = gate_proj.shape[-1]
    down_n, down_k = down_tiles or (block_n, block_k)
    bk_d, d_in = _tile(d, block_k)  # D as the contraction of gate/up
    bn_f, f_out = _tile(f, block_n)  # F as their output
    bk_f, f_in = _tile(f_out, down_k)  # F as the contraction of down
    bn_d, d_out = _tile(d, down_n)  # D as its output
    f_pad = max(f_out, f_in)
    pad3 = lambda a, p1, p2: _pad_weights(a, p1, p2, x.dtype)  # noqa: E731
    e_ids = idx.reshape(-1).astype(jnp.int32)  # [P] pair p = token p // k
    p = e_ids.shape[0]
    s1 = split_k or auto_split_k(p, f_pad, d_in, bn_f, bk_d)
    s2 = split_k or auto_split_k(p, d_out, f_pad, bn_d, bk_f)
    # An explicit split_k must divide both contractions into whole slabs: pad them to a multiple of it (F is
    # also gate/up's output: whole bn_f tiles; all tiles are powers of two, so the larger one is the lcm).
    d_in = -(-d_in // (s1 * bk_d)) * s1 * bk_d
    f_pad = -(-f_pad // max(s2 * bk_f, bn_f)) * max(s2 * bk_f, bn_f)
    rows = jnp.pad(x, [(0, 0), (0, d_in - d)])  # one row per token: its k pairs read it in place
    gate, up = (pad3(a, d_in, f_pad) for a in (gate_proj, up_proj))
    mma = mma and jnp.dtype(x.dtype).itemsize == 2  # float32 rows keep exact multiply-adds (no TF32)
    kw = dict(interpret=interpret, mma=mma, num_stages=3 if mma else 2)
    pad2 = lambda a, p1, p2: jnp.pad(a.astype(x.dtype), [(0, p1 - a.shape[0]), (0, p2 - a.shape[1])])  # noqa: E731
    sh_gu = None if shared is None else (pad2(shared[0], d_in, f_pad), pad2(shared[1], d_in, f_pad))
    sh_d = None if shared is None else (pad2(shared[2], f_pad, d_out),)
    # gate/up's partial sums go straight to the down kernel, which forms its slabs of h from them: at a decode
    # step the XLA kernel that would add them and apply SiLU ⊙ in between costs about as much as either launch
    gu = gate_up_gemv(
        e_ids, rows, gate, up, block_n=bn_f, block_k=bk_d, split_k=s1, pairs_per_row=k, shared=sh_gu,
        partials=True, **kw,
    )  # fmt: skip
    y = down_gemv(
        e_ids, gu, pad3(down_proj, f_pad, d_out), block_n=bn_d, block_k=bk_f, split_k=s2, shared=sh_d,
        h_dtype=x.dtype, swiglu_limit=limit, **kw,
    )  # fmt: skip
    out = jnp.einsum("nk,nkd->nd", w.astype(jnp.float32), y[:p, :d].reshape(n, k, d))
    # the shared expert rounded to x's dtype, as a separate SwiGLU returns it
    return out if shared is None else out + y[p:, :d].astype(x.dtype).astype(jnp.float32)


def _experts_expert_gemv(x, idx, w, gate_proj, up_proj, down_proj, block_n, block_k, split_k, interpret,
                         shared=None, limit=None):  # fmt: skip
    """form="expert_gemv": the pairs grouped by expert (`expert_gemv.group_by_expert`), each touched expert's
    weights read once for its rows, then each pair's row picked out and the weighted sum over k; the shared
    expert (of the routed width F) as one more group of every token's row. Float32 rows take exact products
    (no TF32), as "gemv"."""
    n, d = x.shape
    e, _, f = gate_proj.shape
    bk_d, d_in = _tile(d, block_k)
    bn_f, f_out = _tile(f, block_n)
    bk_f, f_in = _tile(f_out, block_k)
    bn_d, d_out = _tile(d, block_n)
    e_ids, row_token, pair_at = group_by_expert(idx, e)
    g = e_ids.shape[0]
    s1 = split_k or auto_split_k(g, max(f_out, f_in), d_in, bn_f, bk_d)
    s2 = split_k or auto_split_k(g, d_out, max(f_out, f_in), bn_d, bk_f)
    d_in = -(-d_in // (s1 * bk_d)) * s1 * bk_d
    f_pad = max(f_out, f_in)
    f_pad = -(-f_pad // max(s2 * bk_f, bn_f)) * max(s2 * bk_f, bn_f)
    # x with zero rows past the tokens (an empty group row names row n), 32 rows whatever n (one shape for the
    # kernel): it gathers each group's rows itself
    rows = jnp.pad(x, [(0, 2 * GROUP_ROWS - n), (0, d_in - d)])
    sh_gu = sh_d = None
    if shared is not None:  # the shared expert: one more group of every token's row
        row_token = jnp.concatenate([row_token, jnp.arange(GROUP_ROWS, dtype=jnp.int32)[None]])
        pad2 = lambda a, p1, p2: jnp.pad(a.astype(x.dtype), [(0, p1 - a.shape[0]), (0, p2 - a.shape[1])])  # noqa: E731
        sh_gu = (pad2(shared[0], d_in, f_pad), pad2(shared[1], d_in, f_pad))
        sh_d = (pad2(shared[2], f_pad, d_out),)
    pad3 = lambda a, p1, p2: _pad_weights(a, p1, p2, x.dtype)  # noqa: E731
    precision = "ieee" if jnp.dtype(x.dtype).itemsize >= 4 else "tf32"
    kw = dict(interpret=interpret, precision=precision, num_stages=3 if precision == "tf32" else 2)
    gu = gate_up_expert_gemv(
        e_ids, row_token, rows, pad3(gate_proj, d_in, f_pad), pad3(up_proj, d_in, f_pad), block_n=bn_f, block_k=bk_d,
        split_k=s1, shared=sh_gu, **kw,
    )  # fmt: skip
    g_sum, u_sum = clamp_gate_up(jnp.sum(gu[0], axis=1), jnp.sum(gu[1], axis=1), limit)  # one XLA fusion
    h = (jax.nn.silu(g_sum) * u_sum).astype(x.dtype)
    y = down_expert_gemv(
        e_ids, h, pad3(down_proj, f_pad, d_out), block_n=bn_d, block_k=bk_f, split_k=s2, shared=sh_d, **kw
    )
    pairs = y[:g].reshape(g * GROUP_ROWS, d_out)[pair_at][..., :d]  # [N, k, D] float32, each pair's row
    out = jnp.einsum("nk,nkd->nd", w.astype(jnp.float32), pairs, precision=jax.lax.Precision.HIGHEST)
    return out if shared is None else out + y[g, :n, :d].astype(x.dtype).astype(jnp.float32)


def router_kernel_unsupported(x, w, n_group: int) -> str | None:
    """Why the router kernels cannot take this call (None: they can): they need one expert group, x and W of
    one 2-byte dtype, at most `tuning.ROUTER_MAX_ROWS` tokens, 16 <= E <= 1024 and E and D multiples of 16."""
    if n_group != 1:
        return f"n_group=1 (got {n_group})"
    if x.dtype != w.dtype or jnp.dtype(w.dtype).itemsize != 2:
        return f"x and W of one 2-byte dtype (got {x.dtype}, {w.dtype})"
    if x.shape[0] > ROUTER_MAX_ROWS:
        return f"at most {ROUTER_MAX_ROWS} tokens (got {x.shape[0]})"
    if not router_kernel_shapes(*w.shape):
        return f"16 <= E <= 1024 (got {w.shape[1]}), E and D multiples of 16 (got D {w.shape[0]})"
    return None


def moe_route(
    x, w, bias, *, k: int, n_group: int = 1, topk_group: int = 1, scoring: str = "sigmoid",
    norm_topk_prob: bool = True, scaling: float = 1.0, impl: str = "auto", interpret: bool | None = None,
):  # fmt: skip
    """An MoE layer's routing: x [N, D], router weight [D, E], selection bias [E] -> (combine weights [N, k]
    float32, expert ids [N, k] int32), as `reference.route_reference` of the float32 logits x W.

    impl: "reference" (XLA), "pallas" (`router.route_pallas`: the logits' partial sums by the projection GEMV
    kernel, then scores, top-k and renormalisation in one more launch; one expert group, bf16 / fp16 x and W,
    up to `tuning.ROUTER_MAX_ROWS` tokens), or "auto" (`registry.resolve("moe_router", ...)`).
    Ties go to the lower expert id in both."""
    registry.check_impl("moe_router", impl)
    if x.ndim != 2 or w.ndim != 2 or w.shape[0] != x.shape[1] or bias.shape != (w.shape[1],):
        raise ValueError(f"moe_route: inconsistent shapes x={x.shape} w={w.shape} bias={bias.shape}")
    if not 0 < k <= w.shape[1]:
        raise ValueError(f"moe_route: k={k} must be in [1, {w.shape[1]}] experts")
    if scoring not in ("sigmoid", "softmax"):
        raise ValueError(f"moe_route: scoring={scoring!r} must be 'sigmoid' or 'softmax'")
    why_not = router_kernel_unsupported(x, w, n_group)
    impl = registry.resolve("moe_router", impl, why_not=why_not).impl
    if impl == "pallas":
        if why_not is not None:
            raise ValueError(f"moe_route: the kernels need {why_not}")
        interpret = registry.interpret_default(interpret)
        return route_pallas(
            x, w, bias, k=k, scoring=scoring, norm_topk_prob=norm_topk_prob, scaling=float(scaling),
            interpret=interpret,
        )  # fmt: skip
    return route_reference(
        router_logits_reference(x, w), bias, k=k, n_group=n_group, topk_group=topk_group, scoring=scoring,
        norm_topk_prob=norm_topk_prob, scaling=scaling,
    )  # fmt: skip
