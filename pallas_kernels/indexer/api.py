"""Public entry point of the lightning indexer's causal Top-K."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._blocking import dividing_block, over_query_blocks, query_block_size
from pallas_kernels._pallas import auto_impl, pow2
from pallas_kernels.indexer.kernel import MX_BLOCK, indexer_scores_pallas, indexer_scores_tiled_pallas
from pallas_kernels.indexer.prolog import column_groups, indexer_prolog_pallas
from pallas_kernels.indexer.prolog_reference import indexer_prolog_reference
from pallas_kernels.indexer.reference import indexer_topk_reference
from pallas_kernels.indexer.select import top_k_radix
from pallas_kernels.indexer.select_kernel import top_k_rows_pallas, top_k_segmented
from pallas_kernels.indexer.select_split import top_k_split
from pallas_kernels.paged import slot_index

IMPLS = ("auto", "reference", "pallas")
SELECTS = ("kernel", "split", "top_k", "radix")
# Queries per call from which the scores come from the tiled kernel (a key tile read once per query tile):
# prefill. Below it (decode) one program per query walks its keys.
TILED_MIN_QUERIES = 64
TILED_BLOCK_Q = 64  # queries per tile (H200, 5beadda: 64x128 tiles 41.6 ms, 128x128 48.9, 64x64 46.0)
SELECT_CHUNK = 4096  # scores per step of the selection kernel
# What `select=None` picks (H200 measurements in BENCHMARKS.md). One program per row is latency-bound on a
# long row (5beadda: 1.0 ms for one 128K row, `lax.top_k` 0.07 ms) but a prefill's thousands of rows fill
# the GPU (32K prefill: 41.6 ms vs 85.8 with top_k): the kernel from SELECT_KERNEL_MIN_ROWS rows. Fewer
# rows with long contexts (>= SPLIT_MIN_KEYS_PER_K x topk keys) go to the split selection, whose passes
# over each row run on many programs (c154445, decode at 10 chained calls: 128K B=16 0.356 ms vs 0.400
# with the rows cut into 8 segments and 0.665 with `lax.top_k`; B=64 1.068 vs 1.089 with 4 segments; 32K
# B=16 0.162 vs 0.181 top_k; B=1 128K 0.108 vs 0.107 top_k, both sorted — unsorted, as the model asks,
# 0.101); shorter contexts keep `lax.top_k`. The 8 x topk boundary is the segmented rule's it replaced:
# contexts from 16K to below 32K have not been timed against `lax.top_k`.
SELECT_KERNEL_MIN_ROWS = 512
SPLIT_MIN_KEYS_PER_K = 8
# Rows of at most this many times topk keys (decode with a context near or below topk) go to the selection
# kernel at any row count: `lax.top_k` with K this close to the row length sorts the whole row (H200,
# hybrid_small decode B=1 at 2K context: 19.2 us per sparse layer for one 2112-score row, 6% of the step;
# the kernel 9.2 us, profile_stage at c8ddf8f): the kernel takes a row of <= topk scores whole in one
# compaction pass and otherwise stops its radix search within a few passes over one or two chunks.
NEAR_FULL_KEYS_PER_K = 2
# Up to this many rows the split selection ranks its candidates best first in its own kernels (one program
# per 16 candidates: O(candidates^2) compares, wide at B=1) instead of one selection program per row and XLA's
# sort of the K chosen afterwards (H200, one 128K row, 40 chained calls: the whole split selection 35-36 us
# best first at 4cf71f9 / 19271fa, 71.7 us selected then sorted; 42 us selected alone at 9f0f6d1). The
# ranking's work grows as rows x candidates^2: at 16 rows (~74 M compares) it has not been timed
# against the per-row selection, so the rule keeps it to a few rows (timed at one).
RANK_MAX_ROWS = 4


def default_selection(rows: int, keys: int, topk: int) -> tuple[str, int]:
    """(select, segments) that `indexer_topk(select=None)` uses for `rows` score rows of `keys` keys."""
    if rows >= SELECT_KERNEL_MIN_ROWS or keys <= NEAR_FULL_KEYS_PER_K * topk:
        return "kernel", 1
    if keys >= SPLIT_MIN_KEYS_PER_K * topk:
        return "split", 1
    return "top_k", 1


PRECISIONS = ("bf16", "tf32", "ieee")
# Keys per program of the one-query score kernel: 1024 (32f2129+), or 512 with 3 pipeline stages when that
# gives fewer than FEW_SCORE_PROGRAMS programs (B=1 at 128K: 128 programs for 132 SMs, each latency-bound;
# H200 at 4cf71f9, the kernel alone with its statistics, 40 chained calls: 20.7 vs 26.3 us).
FEW_SCORE_PROGRAMS = 264


def default_keys_per_program(queries: int, keys: int) -> tuple[int, int]:
    """(keys per program, pipeline stages) of the one-query score kernel for `queries` rows of `keys` keys."""
    return (512, 3) if queries * -(-keys // 1024) < FEW_SCORE_PROGRAMS else (1024, 2)


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
    "auto" (Pallas on GPU when H is a power of two >= 32, else the reference). With `k_scales` [P,G,H/32]
    E8M0 the pool holds MXFP8 E4M3 values: the kernels dequantize the rows they read, the reference
    dequantizes the pool first.
    Kernel knobs: `block_s` keys per step, `keys_per_program` keys per program of the one-query kernel
    (a multiple of block_s, None for one block, "auto" for `default_keys_per_program`), `block_q` queries per
    program of the tiled kernel
    (`kernel.indexer_scores_tiled_pallas`, key tiles of block_s; None: TILED_BLOCK_Q from TILED_MIN_QUERIES on,
    else the one-query kernel; 0: always the one-query kernel), `precision` of the score products: "bf16"
    (q and keys in bfloat16, float32 accumulation; the default for 2-byte queries, as `sparse_mla`), "tf32"
    (the default otherwise) or "ieee"; `select` "kernel" (`select_kernel.top_k_rows_pallas`: radix select
    of each row's visible prefix — long rows first narrowed to k..2k candidates by its prefilter kernel — then
    a sort of the K chosen), "split" (`select_split.top_k_split`: the same selection with each row's
    passes spread over many programs, for a few long rows), "top_k" (`lax.top_k`) or "radix"
    (`select.top_k_radix`), the same result; None: `default_selection` (measured on the H200).
    `sort=False` lets the selection kernel return each query's chosen positions in ascending position order
    (the same set, -1 / -inf pads last) without the final sort of K per query: for callers that, like
    sparse attention, do not depend on the order. The split selection of up to RANK_MAX_ROWS rows ranks its
    candidates best first in its own kernels (`top_k_split(best_first=True)`): the sorted order either way.
    `select_segments` > 1 cuts each score row into that many pieces selected in parallel, then selects among
    their candidates (`select_kernel.top_k_segmented`: for a few long rows, as in decode; None:
    `default_selection`, 1 for an explicit `select`).
    """
    if impl not in IMPLS:
        raise ValueError(f"indexer_topk: unknown impl={impl!r}; expected one of {IMPLS}")
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
    if impl == "auto":
        impl = "pallas" if auto_impl("indexer", h == pow2(h) and h >= MX_BLOCK) else "reference"
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
    interp = jax.default_backend() == "cpu" if interpret is None else interpret
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
    qbs = dividing_block(q.shape[1], qbs, block_q or 1)  # no padded copy of q (H200 32K prefill: 0.39 ms a layer)
    idx, vals = over_query_blocks(block, qbs, q, w, q_positions)
    return idx[:, :t], vals[:, :t]


# Rows (batch x new tokens) up to which the fused prolog kernel takes a call: decode. Prefill-sized
# projections are matmuls that cuBLAS tiles better than one program per head.
PROLOG_MAX_ROWS = 64
# The kernel is opt-in (`use_pallas(ops=["indexer_prolog"])`), not the GPU default: on the H200 it is slower
# than XLA's step-by-step prolog (hybrid_small, batch 1, 10 chained calls, BENCHMARKS.md kernel_count.py at
# fb4b779: 0.058 ms fused vs 0.017 ms for XLA's 13 kernels; whole decode step 3.05 vs 2.95 ms). One program
# per head streams its [Q, H] weight columns serially and the key and head-weight programs each stream a
# whole [D, H] / [D, N] matrix alone: a few CTAs that are latency-bound, where XLA's GEMV kernels spread the
# same bytes over every SM — fewer launches do not pay for that at these sizes.
PROLOG_DEFAULT_ON_GPU = False


def prolog_supported(rows: int, q_in: int, d: int, num_heads: int, head_dim: int, rope_dim: int) -> bool:
    """Whether the fused prolog kernel takes these shapes on a GPU: power-of-two column groups of >= 16
    (tensor-core tiles), contraction dims in whole 16-row slabs, decode-sized row counts."""
    widths = [w for _, w in column_groups(head_dim, rope_dim)] + [num_heads]
    return rows <= PROLOG_MAX_ROWS and all(w >= 16 and w == pow2(w) for w in widths) and q_in % 16 == 0 and d % 16 == 0


def prolog_uses_kernel(rows: int, q_in: int, d: int, num_heads: int, head_dim: int, rope_dim: int) -> bool:
    """What `indexer_prolog(impl="auto")` runs: the kernel for supported (decode) shapes inside a
    `use_pallas` block covering "indexer_prolog" (or on a GPU if PROLOG_DEFAULT_ON_GPU), else the reference."""
    supported = prolog_supported(rows, q_in, d, num_heads, head_dim, rope_dim)
    return auto_impl("indexer_prolog", supported, default_on_gpu=PROLOG_DEFAULT_ON_GPU)


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
    """The lightning indexer's inputs for one step (ARCH_SPEC §4; math in `prolog_reference`).

    x [M, D], c_q [M, Q] in the compute dtype; wq_b [Q, N·H], wk [D, H] projection kernels; ln_w / ln_b [H]
    the key LayerNorm; wp [D, N] the head-weight projection (float32); cos / sin [M, R/2] RoPE tables (half-
    split, on the first R = rope_dim channels). Returns (q [M, N, H] and k [M, H] in x.dtype, w [M, N]
    float32 = (x W_w) N^-1/2).
    impl: "reference" (jnp), "pallas" (`prolog.indexer_prolog_pallas`: the whole prolog in one launch), or
    "auto" (`prolog_uses_kernel`: the reference unless a `use_pallas` block asks for the kernel — measured
    slower than XLA on the H200, see PROLOG_DEFAULT_ON_GPU).
    """
    if impl not in IMPLS:
        raise ValueError(f"indexer_prolog: unknown impl={impl!r}; expected one of {IMPLS}")
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
    interpret = jax.default_backend() == "cpu" if interpret is None else interpret
    return indexer_prolog_pallas(x, c_q, wq_b, wk, ln_w, ln_b, wp, cos, sin, interpret=interpret, **kw)
