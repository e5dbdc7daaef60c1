"""Public entry point of the lightning indexer's causal Top-K."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import registry
from pallas_kernels._blocking import dividing_block, over_query_blocks, query_block_size
from pallas_kernels._pallas import pow2
from pallas_kernels.indexer.kernel import MX_BLOCK, indexer_scores_pallas, indexer_scores_tiled_pallas
from pallas_kernels.indexer.prolog import column_groups, indexer_prolog_pallas
from pallas_kernels.indexer.prolog_reference import indexer_prolog_reference
from pallas_kernels.indexer.reference import indexer_topk_reference
from pallas_kernels.indexer.select_kernel import top_k_rows_pallas, top_k_segmented
from pallas_kernels.indexer.select_reference import top_k_radix
from pallas_kernels.indexer.select_split import top_k_split
from pallas_kernels.indexer.tuning import (
    FEW_KEYS_PER_PROGRAM,
    FEW_SCORE_PROGRAMS,
    FEW_STAGES,
    KEYS_PER_PROGRAM,
    PROLOG_MAX_ROWS,
    RANK_MAX_ROWS,
    SELECT_CHUNK,
    STAGES,
    TILED_BLOCK_Q,
    TILED_MIN_QUERIES,
)
from pallas_kernels.paged import slot_index

SELECTS = ("kernel", "split", "top_k", "radix")
PRECISIONS = ("bf16", "tf32", "ieee")


def default_selection(rows: int, keys: int, topk: int) -> tuple[str, int]:
    """(select, segments) that `indexer_topk(select=None)` uses for `rows` score rows of `keys` keys
    (`registry.selection`)."""
    return registry.selection(rows, keys, topk)[0], 1


def default_keys_per_program(queries: int, keys: int) -> tuple[int, int]:
    """(keys per program, pipeline stages) of the one-query score kernel for `queries` rows of `keys` keys."""
    few = queries * -(-keys // KEYS_PER_PROGRAM) < FEW_SCORE_PROGRAMS
    return (FEW_KEYS_PER_PROGRAM, FEW_STAGES) if few else (KEYS_PER_PROGRAM, STAGES)


def indexer_topk(
    q,
    w,
    k_pages,
    page_table,
    *,
    q_positions,
    kv_lengths,
    topk: int,
    scale: float,
    impl: str = "auto",
    k_scales=None,
    block_s: int = 128,
    keys_per_program: int | str | None = "auto",
    block_q: int | None = None,
    select: str | None = None,
    sort: bool = True,
    select_segments: int | None = None,
    precision: str | None = None,
    interpret: bool | None = None,
):
    """Top-K key positions per query from the paged indexer key cache.

    q [B,T,N,H] indexer queries; w [B,T,N] head weights; k_pages [P,G,H] key pool; page_table [B,n];
    q_positions [B,T]; kv_lengths [B]. Returns (indices [B,T,topk] int32, -1 = none; scores [B,T,topk]
    float32, -inf where none), best first, ties to the lower position.
    impl: "reference" (jnp), "pallas" (scores straight from the pool by `kernel.indexer_scores_pallas` or,
    for many queries, `kernel.indexer_scores_tiled_pallas`, then a selection per block of queries), or
    "auto" (`registry.resolve("indexer", ...)`: the kernels take H a power of two >= 32). With `k_scales` [P,G,H/32]
    E8M0 the pool holds MXFP8 E4M3 values: the kernels dequantize the rows they read, the reference
    dequantizes the pool first.
    Kernel knobs: `block_s` keys per step, `keys_per_program` keys per program of the one-query kernel
    (a multiple of block_s, None for one block, "auto" for `default_keys_per_program`), `block_q` queries per
    program of the tiled kernel (`kernel.indexer_scores_tiled_pallas`, key tiles of block_s; None:
    `tuning.TILED_BLOCK_Q` from `tuning.TILED_MIN_QUERIES` queries on, else the one-query kernel; 0: always
    the one-query kernel), `precision` of the score products: "bf16"
    (q and keys in bfloat16, float32 accumulation; the default for 2-byte queries, as `sparse_mla`), "tf32"
    (the default otherwise) or "ieee"; `select` "kernel" (`select_kernel.top_k_rows_pallas`: radix select
    of each row's visible prefix — long rows first narrowed to k..2k candidates by its prefilter kernel — then
    a sort of the K chosen), "split" (`select_split.top_k_split`: the same selection with each row's
    passes spread over many programs, for a few long rows), "top_k" (`lax.top_k`) or "radix"
    (`select_reference.top_k_radix`, jnp), the same result; None: `registry.selection`.
    `sort=False` lets the selection kernel return each query's chosen positions in ascending position order
    (the same set, -1 / -inf pads last) without the final sort of K per query: for callers that, like
    sparse attention, do not depend on the order. The split selection of up to `tuning.RANK_MAX_ROWS` rows ranks its
    candidates best first in its own kernels (`top_k_split(best_first=True)`): the sorted order either way.
    `select_segments` > 1 cuts each score row into that many pieces selected in parallel, then selects among
    their candidates (`select_kernel.top_k_segmented`: for a few long rows, as in decode; None:
    `default_selection`, 1 for an explicit `select`).
    """
    registry.check_impl("indexer", impl)
    if topk <= 0:
        raise ValueError(f"indexer_topk: topk={topk} must be positive")
    if not scale > 0:  # the indexer's softmax-free scale (head dim^-1/2); the tiled kernel moves it out of the ReLU
        raise ValueError(f"indexer_topk: scale={scale} must be positive")
    if select is None:
        select, auto_segments = default_selection(q.shape[0] * q.shape[1], page_table.shape[1] * k_pages.shape[1], topk)
        select_segments = auto_segments if select_segments is None else select_segments
    select_segments = 1 if select_segments is None else select_segments
    if select not in SELECTS:
        raise ValueError(f"indexer_topk: unknown select={select!r}; expected one of {SELECTS}")
    if precision is None:
        precision = "bf16" if jnp.dtype(q.dtype).itemsize == 2 else "tf32"
    if precision not in PRECISIONS:
        raise ValueError(f"indexer_topk: unknown precision={precision!r}; expected one of {PRECISIONS}")
    stages = 2
    if keys_per_program == "auto":
        keys_per_program, stages = default_keys_per_program(
            q.shape[0] * q.shape[1], page_table.shape[1] * k_pages.shape[1]
        )
    span = block_s if keys_per_program is None else keys_per_program
    if block_s < 16 or block_s & (block_s - 1) or span % block_s:
        raise ValueError(
            f"indexer_topk: block_s={block_s} must be a power of two >= 16 and keys_per_program={keys_per_program} "
            "a multiple of it"
        )
    if select_segments < 1 or select_segments & (select_segments - 1):
        raise ValueError(f"indexer_topk: select_segments={select_segments} must be a power of two >= 1")
    if select_segments > 1 and select != "kernel":
        raise ValueError(f"indexer_topk: select_segments={select_segments} needs select='kernel', not {select!r}")
    if block_q is not None and block_q != 0 and (block_q < 16 or block_q & (block_q - 1)):
        raise ValueError(f"indexer_topk: block_q={block_q} must be 0, None or a power of two >= 16")
    h = q.shape[-1]
    if k_scales is not None and k_scales.shape[-1] * MX_BLOCK != h:
        raise ValueError(f"indexer_topk: k_scales width {k_scales.shape[-1]} is not head dim {h} / {MX_BLOCK}")
    rows, keys = q.shape[0] * q.shape[1], page_table.shape[1] * k_pages.shape[1]
    impl = registry.resolve("indexer", impl, head_dim=h, rows=rows, keys=keys, topk=topk).impl
    if impl != "pallas":
        if k_scales is not None:  # E8M0: a power of two 2^(bits - 127) per 32 values
            exp = jax.lax.bitcast_convert_type(k_scales, jnp.uint8).astype(jnp.float32) - 127.0
            blocks = k_pages.astype(jnp.float32).reshape(*k_pages.shape[:-1], -1, MX_BLOCK)
            k_pages = (blocks * jnp.exp2(exp)[..., None]).reshape(k_pages.shape)
        return indexer_topk_reference(
            q, w, k_pages, page_table, q_positions=q_positions, kv_lengths=kv_lengths, topk=topk, scale=scale
        )
    b, t, n, h = q.shape
    g = k_pages.shape[1]
    s_len = page_table.shape[1] * g
    if block_q is None:
        block_q = TILED_BLOCK_Q if t >= TILED_MIN_QUERIES else 0
    chunk = min(SELECT_CHUNK, pow2(s_len))
    # key slots: whole score programs, and whole selection chunks (segments) when the kernel selects
    unit = span if block_q == 0 else block_s  # powers of two, as chunk
    if select in ("kernel", "split"):
        unit = max(unit, select_segments * chunk)
    s_pad = -(-s_len // unit) * unit
    slots = None
    if block_q:  # the tiled kernel reads each key tile's pool rows from here
        slots = slot_index(page_table, jnp.broadcast_to(jnp.arange(s_pad, dtype=jnp.int32), (b, s_pad)), g)
        slots = jnp.where(jnp.arange(s_pad)[None, :] < s_len, slots, -1)
    page_table = page_table.astype(jnp.int32)
    w = w.astype(jnp.float32)
    if block_q:  # padded queries: position -1 sees nothing
        t_pad = -(-t // block_q) * block_q
        q = jnp.pad(q, [(0, 0), (0, t_pad - t), (0, 0), (0, 0)])
        w = jnp.pad(w, [(0, 0), (0, t_pad - t), (0, 0)])
        q_positions = jnp.pad(q_positions, [(0, 0), (0, t_pad - t)], constant_values=-1)
    else:
        n_pad = max(16, n)  # the tensor-core product needs 16 rows; zero heads with zero weight add nothing
        q = jnp.pad(q, [(0, 0), (0, 0), (0, n_pad - n), (0, 0)])
        w = jnp.pad(w, [(0, 0), (0, 0), (0, n_pad - n)])
    rows = k_pages.reshape(-1, h)
    scales = None
    if k_scales is not None:
        scales = jax.lax.bitcast_convert_type(k_scales, jnp.uint8).reshape(-1, h // 32)
    k_eff = min(topk, s_len)
    interp = registry.interpret_default(interpret)
    kv_lengths = kv_lengths.astype(jnp.int32)

    def block(qb, wb, pb):
        pb = pb.astype(jnp.int32)
        stats = limits = None
        if block_q:
            scores = indexer_scores_tiled_pallas(
                qb, wb, pb, kv_lengths, slots, rows, scales, scale=float(scale), block_q=block_q, block_k=block_s,
                precision=precision, interpret=interp,
            )  # fmt: skip
        else:
            # the pool rows from the page table in the kernel; the split selection starts from the statistics
            # and limits the kernel takes of its own scores (a decode step: no XLA kernel before or between)
            scores = indexer_scores_pallas(
                qb, wb, pb, kv_lengths, page_table, rows, scales, scale=float(scale), block_s=block_s,
                steps=span // block_s, precision=precision, interpret=interp, stats=select == "split",
                keys_major=True, num_stages=stages, page_size=g, keys=s_pad,
            )  # fmt: skip
            if select == "split":
                scores, stats, limits = scores
                stats, limits = stats.reshape(-1, *stats.shape[2:]), limits.reshape(-1)
        if select in ("kernel", "split"):
            if limits is None:
                limits = jnp.clip(jnp.minimum(pb + 1, kv_lengths[:, None]), 0, s_len)  # [B, Tb]
            flat, lim = scores.reshape(-1, s_pad), limits.reshape(-1)
            ranked = select == "split" and flat.shape[0] <= RANK_MAX_ROWS
            if select == "split":
                vals, idx = top_k_split(
                    flat, lim, k=topk, chunk=chunk, best_first=ranked, stats=stats,
                    stats_parts=None if stats is None else s_pad // span, interpret=interp,
                )  # fmt: skip
            elif select_segments > 1:
                vals, idx = top_k_segmented(flat, lim, k=topk, segments=select_segments, chunk=chunk, interpret=interp)
            else:
                vals, idx = top_k_rows_pallas(flat, lim, k=topk, chunk=chunk, interpret=interp)
            if sort and not ranked:  # ascending positions -> best first, ties to the lower position; pads last
                neg, idx = jax.lax.sort((-vals, idx), dimension=-1, num_keys=2)
                vals = -neg
            return idx.reshape(b, -1, topk), vals.reshape(b, -1, topk)
        scores = scores[..., :s_len]
        # ties: the lower position first (both selections)
        vals, idx = jax.lax.top_k(scores, k_eff) if select == "top_k" else top_k_radix(scores, k_eff)
        idx = jnp.where(jnp.isneginf(vals), -1, idx).astype(jnp.int32)
        if k_eff < topk:
            extra = [(0, 0), (0, 0), (0, topk - k_eff)]
            idx = jnp.pad(idx, extra, constant_values=-1)
            vals = jnp.pad(vals, extra, constant_values=-jnp.inf)
        return idx, vals

    # Queries in blocks: the [T, S] scores are never all in memory (prefill memory grows as T x topk).
    qbs = query_block_size(q.shape[1], b * s_pad)
    if block_q:
        qbs = max(block_q, qbs // block_q * block_q)
    qbs = dividing_block(q.shape[1], qbs, block_q or 1)  # no padded copy of q (a pass over it per layer)
    idx, vals = over_query_blocks(block, qbs, q, w, q_positions)
    return idx[:, :t], vals[:, :t]


def prolog_supported(rows: int, q_in: int, d: int, num_heads: int, head_dim: int, rope_dim: int) -> bool:
    """Whether the fused prolog kernel takes these shapes on a GPU: power-of-two column groups of >= 16
    (tensor-core tiles), contraction dims in whole 16-row slabs, decode-sized row counts."""
    widths = [w for _, w in column_groups(head_dim, rope_dim)] + [num_heads]
    return rows <= PROLOG_MAX_ROWS and all(w >= 16 and w == pow2(w) for w in widths) and q_in % 16 == 0 and d % 16 == 0


def prolog_uses_kernel(rows: int, q_in: int, d: int, num_heads: int, head_dim: int, rope_dim: int) -> bool:
    """Whether `indexer_prolog(impl="auto")` runs the fused kernel (`registry.resolve("indexer_prolog")`:
    opt-in, it measured slower than XLA's kernels)."""
    ok = prolog_supported(0, q_in, d, num_heads, head_dim, rope_dim)
    return registry.resolve("indexer_prolog", rows=rows, widths_ok=ok).impl == "pallas"


def indexer_prolog(
    x,
    c_q,
    wq_b,
    wk,
    ln_w,
    ln_b,
    wp,
    cos,
    sin,
    *,
    num_heads: int,
    rope_dim: int,
    eps: float,
    impl: str = "auto",
    interpret: bool | None = None,
):
    """The lightning indexer's inputs for one step (math in `prolog_reference`; docs/architecture.md).

    x [M, D], c_q [M, Q] in the compute dtype; wq_b [Q, N·H], wk [D, H] projection kernels; ln_w / ln_b [H]
    the key LayerNorm; wp [D, N] the head-weight projection (float32); cos / sin [M, R/2] RoPE tables (half-
    split, on the first R = rope_dim channels). Returns (q [M, N, H] and k [M, H] in x.dtype, w [M, N]
    float32 = (x W_w) N^-1/2).
    impl: "reference" (jnp), "pallas" (`prolog.indexer_prolog_pallas`: the whole prolog in one launch), or
    "auto" (`prolog_uses_kernel`: the reference unless a `use_pallas` block asks for the kernel, which
    measured slower than XLA's kernels).
    """
    registry.check_impl("indexer_prolog", impl)
    m, d = x.shape
    h = wk.shape[1]
    checks = {
        "c_q": (c_q.shape, (m, c_q.shape[1])),
        "wq_b": (wq_b.shape, (c_q.shape[1], num_heads * h)),
        "wk": (wk.shape, (d, h)),
        "ln_w": (ln_w.shape, (h,)),
        "ln_b": (ln_b.shape, (h,)),
        "wp": (wp.shape, (d, num_heads)),
        "cos": (cos.shape, (m, rope_dim // 2)),
        "sin": (sin.shape, (m, rope_dim // 2)),
    }
    for name, (got, want) in checks.items():
        if tuple(got) != want:
            raise ValueError(f"indexer_prolog: {name}.shape={tuple(got)}, expected {want}")
    if rope_dim % 2 or not 0 <= rope_dim <= h:
        raise ValueError(f"indexer_prolog: rope_dim={rope_dim} must be even and in [0, head dim {h}]")
    kw = dict(num_heads=num_heads, rope_dim=rope_dim, eps=eps)
    if impl == "auto":
        impl = "pallas" if prolog_uses_kernel(m, c_q.shape[1], d, num_heads, h, rope_dim) else "reference"
    if impl == "reference":
        return indexer_prolog_reference(x, c_q, wq_b, wk, ln_w, ln_b, wp, cos, sin, **kw)
    interpret = registry.interpret_default(interpret)
    return indexer_prolog_pallas(x, c_q, wq_b, wk, ln_w, ln_b, wp, cos, sin, interpret=interpret, **kw)
