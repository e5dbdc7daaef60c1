"""Sparse-attention kernels on one GPU: the lightning indexer (scores + Top-K) and index-based sparse MLA,
Pallas against the jnp reference (materialised scores + `lax.top_k`; gathered rows) in the same run.

Decode rows: the indexer and the Top-K alone run `--fresh-calls` calls on fresh inputs in one executable
(`common.fresh_ms`: no host dispatch per call, nothing XLA can hoist or share between calls; key pools up to
FRESH_POOL_MAX_BYTES drawn anew per call so none stays in the L2); the executable's launch and wait (~0.3-0.5
ms) is spread over the calls, so the check column also gives the kernels' span per call from a profiler trace
(`common.fresh_device_ms`). Sparse MLA decode runs `--chain` separate dispatches queued back to back (each
pays its launch; ~0.1 ms calls at B=64 hide the host's dispatch); on a GPU their check column adds the kernels'
time a call from a profiler trace of such dispatches (`common.dispatched_kernel_ms`): smaller calls wait on the
host, and their wall time does not compare kernels.
Prefill rows: one call at a time, median of a few.

Floors: bytes that must move over the measured HBM bandwidth and FLOPs over the measured bf16 matmul rate
(the larger). Indexer: the key cache read once (BF16, or MXFP8 values + E8M0 scales) plus the queries;
FLOPs 2·N·H per query-key pair. Sparse MLA (`_mla_work`): FLOPs 2·N·(2L + R) per selected row (an early
causal query selects fewer than K); bytes the queries and outputs, and the selected rows once per query at
decode, each pool row once at prefill (a prefill's pool stays in the L2 between its queries).

    python -m benchmarks.sparse_attention [--contexts 32768 131072] [--batches 1 16 64] [--only indexer|mla]
        [--indexer-variants 128:1024:bf16 ...] [--prefill-variants 64:128:kernel ...] [--no-prefill-reference]
        [--chain 10] [--fresh-calls 40] [--topk-kinds normal cauchy ties constant relu_zeros] [--topk-rows 1 64]
        [--no-record]
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (
    CHAIN,
    ceilings,
    dispatched_kernel_ms,
    fresh_device_ms,
    fresh_ms,
    median_ms,
    rel_err,
    report,
)
from benchmarks.common import roofline_row as row
from hybrid_jax.quant.formats import quantize_kv_fp8, quantize_mxfp8
from pallas_kernels._pallas import pow2
from pallas_kernels.indexer import indexer_topk
from pallas_kernels.indexer.api import default_keys_per_program, default_selection
from pallas_kernels.indexer.select_kernel import top_k_rows_pallas
from pallas_kernels.indexer.select_split import top_k_split
from pallas_kernels.indexer.tuning import RANK_MAX_ROWS, SELECT_CHUNK
from pallas_kernels.registry import is_sm90
from pallas_kernels.sparse_attention import sparse_mla
from pallas_kernels.sparse_attention.api import default_tiles, dequantizes_pool

PAGE = 64


# Sparse MLA kernel variants: (block_h, block_k, precision, splits; None = the `num_splits` rule). The bf16
# rows and the explicit splits at decode are candidates added after the last GPU run (not yet timed).
MLA_VARIANTS = ((16, 32, "tf32", None), (16, 64, "tf32", None), (32, 32, "tf32", None), (32, 32, "bf16", None))
MLA_DECODE_VARIANTS = ((32, 32, "bf16", 4), (64, 32, "bf16", None))


def _kernel_note(fn, *args, calls: int) -> str:
    """ "; kernels X ms a call" of `calls` separate dispatches of fn (`dispatched_kernel_ms`) on a GPU, for the
    check column beside their wall time; "" elsewhere."""
    k = dispatched_kernel_ms(fn, *args, calls=calls) if jax.default_backend() == "gpu" else None
    return "" if k is None else f"; kernels {k:.3f} ms a call"


def _single_ms(fn, *args, iters):
    return median_ms(functools.partial(fn, *args), warmup=1, iters=iters)


def _pool(key, b, s, width, dtype):
    pages = b * (s // PAGE)
    pool = jax.random.normal(key, (pages, PAGE, width), jnp.float32).astype(dtype)
    table = jnp.arange(pages, dtype=jnp.int32).reshape(b, s // PAGE)
    return pool, table


def _same_topk(got, ref) -> str:
    got, ref = np.asarray(got), np.asarray(ref)
    overlap = np.mean(
        [
            len(np.intersect1d(a[a >= 0], r[r >= 0])) / max(1, (r >= 0).sum())
            for a, r in zip(got.reshape(-1, got.shape[-1]), ref.reshape(-1, ref.shape[-1]), strict=True)
        ]
    )
    return f"Top-K overlap {overlap:.4f}"


# Indexer score-kernel variants "block_s:keys_per_program:precision"; 64:64:tf32 is the kernel as it was
# until 8be418f (one 64-key block per program, float32 products); 128:1024:bf16 the default since 32f2129+.
INDEXER_VARIANTS = ("128:auto:bf16",)  # auto: `indexer.api.default_keys_per_program`
# Decode selections "select[:segments]" timed after each score variant.
DECODE_SELECTS = ("default", "top_k")  # "default": `indexer.default_selection`
# Prefill variants "block_q:block_s:select" (block_q 0: the one-query kernel, as before the tiled one).
PREFILL_VARIANTS = ("0:128:top_k", "64:128:top_k", "64:128:kernel", "128:128:kernel", "64:64:kernel")


def _indexer_variant(text: str) -> dict:
    bs, kpp, prec = text.split(":")
    return dict(block_s=int(bs), keys_per_program=kpp if kpp == "auto" else int(kpp), precision=prec)


def _prefill_variant(text: str) -> dict:
    bq, bs, select = text.split(":")
    return dict(block_q=int(bq), block_s=int(bs), select=select)


# Decode timings run `--fresh-calls` calls on fresh inputs in one executable (`common.fresh_ms`). Key pools up to this
# size are drawn anew for each call: a smaller pool could stay in the 50 MB L2 between calls, which a decode
# step's pool does not (the other layers' reads come between); larger ones are shared (no L2 reuse possible).
FRESH_POOL_MAX_BYTES = 256 * 2**20


def _indexer_draw(key, b, s, heads, dim, pool=None):
    """One decode call's inputs: queries [B, 1, H, D], weights [B, 1, H], and a key pool (drawn unless given)."""
    ks = jax.random.split(key, 3)
    pool = _pool(ks[0], b, s, dim, jnp.bfloat16)[0] if pool is None else pool
    q = jax.random.normal(ks[1], (b, 1, heads, dim), jnp.bfloat16)
    return q, jax.random.normal(ks[2], (b, 1, heads), jnp.float32), pool


def _selection(select: str, best_first: bool, s: int, topk: int, **knobs):
    """A jitted Top-K of [R, S] float32 scores (every score a candidate) by one of our selections (knobs:
    `top_k_split`'s tuning arguments)."""
    interpret = jax.default_backend() == "cpu"
    if select == "kernel":
        return jax.jit(
            lambda x: top_k_rows_pallas(
                x, jnp.full((x.shape[0],), s, jnp.int32), k=topk, chunk=min(SELECT_CHUNK, pow2(s)),
                interpret=interpret,
            )
        )  # fmt: skip
    return jax.jit(
        lambda x: top_k_split(
            x, jnp.full((x.shape[0],), s, jnp.int32), k=topk, chunk=min(SELECT_CHUNK, pow2(s)), best_first=best_first,
            interpret=interpret, **knobs,
        )
    )  # fmt: skip


def indexer_rows(
    bw, rate, contexts, batches, heads, dim, topk, prefill_len, variants=INDEXER_VARIANTS,
    prefill_variants=PREFILL_VARIANTS, prefill_reference=True, select_variants=(), decode_selects=DECODE_SELECTS,
    chain=CHAIN,
) -> list[dict]:  # fmt: skip
    rows = []
    for s, b in ((s, b) for s in contexts for b in batches):
        ks = jax.random.split(jax.random.key(s + b), chain + 1)
        table = jnp.arange(b * (s // PAGE), dtype=jnp.int32).reshape(b, s // PAGE)
        fresh_pool = b * s * dim * 2 <= FRESH_POOL_MAX_BYTES
        draws = [_indexer_draw(ks[1], b, s, heads, dim)]
        draws += [_indexer_draw(k, b, s, heads, dim, None if fresh_pool else draws[0][2]) for k in ks[2:]]
        calls = [(q, w, pool, table) for q, w, pool in draws]
        q, w, pool, _ = calls[0]

        pos = jnp.full((b, 1), s - 1, jnp.int32)
        lens = jnp.full((b,), s, jnp.int32)
        kw = dict(q_positions=pos, kv_lengths=lens, topk=topk, scale=dim**-0.5)
        flops = 2 * b * s * heads * dim
        shape = f"decode B={b} S={s} heads={heads}x{dim} top-{topk}, {chain} calls, fresh inputs"
        shape += "" if fresh_pool else " (one shared key pool)"
        ref = jax.jit(lambda q, w, p, t, kw=kw: indexer_topk(q, w, p, t, impl="reference", **kw))
        ref_i, _ = ref(q, w, pool, table)
        ms = fresh_ms(ref, calls)
        rows.append(row("indexer", shape, "jnp reference (scores + top_k)", ms, flops, pool.nbytes, bw, rate,
                        _device_note(ref, calls)))  # fmt: skip
        for variant in variants:
            for spec in decode_selects:
                select, _, segs = spec.partition(":")
                if select == "default":
                    select, segs = default_selection(b, s, topk)
                vk = dict(_indexer_variant(variant), select=select, select_segments=int(segs or 1), sort=False)
                fn = jax.jit(lambda q, w, p, t, kw=kw, vk=vk: indexer_topk(q, w, p, t, impl="pallas", **vk, **kw))
                got_i, _ = fn(q, w, pool, table)
                ms = fresh_ms(fn, calls)
                how = {"top_k": "lax.top_k", "split": "split selection (row passes over many programs)"}.get(
                    select, f"selection kernel, {vk['select_segments']} segments"
                )
                how += " (the default)" if spec == "default" else ""
                kpp = vk["keys_per_program"]
                kpp = default_keys_per_program(b, s)[0] if kpp == "auto" else kpp
                impl = (
                    f"pallas scores (bf16 pool, block_s={vk['block_s']}, {kpp} keys/program, "
                    f"{vk['precision']} products) + {how}"
                )
                check = _same_topk(got_i, ref_i)
                check += f"; {_device_note(fn, calls)}" if spec == "default" else ""
                rows.append(row("indexer", shape, impl, ms, flops, pool.nbytes, bw, rate, check))
        # the selection alone, on fresh scores of the same shape: how much of the time the Top-K takes
        scores = [(jax.random.normal(jax.random.fold_in(k, 7), (b, s), jnp.float32),) for k in ks[1:]]
        topk_only = jax.jit(lambda x: jax.lax.top_k(x, topk))
        ms = fresh_ms(topk_only, scores)
        rows.append(row("indexer", shape, "lax.top_k alone on [B, S] scores", ms, 0, scores[0][0].nbytes, bw, rate))
        for select, best_first in (("kernel", False), ("split", b <= RANK_MAX_ROWS)):
            fn = _selection(select, best_first, s, topk)
            label = "selection kernel alone on [B, S]"
            if select == "split":
                label = f"split selection alone on [B, S] (its own statistics pass{', best first' * best_first})"
            rows.append(row("indexer", shape, label, fresh_ms(fn, scores), 0, scores[0][0].nbytes, bw, rate))
        shared_mx = None if fresh_pool else quantize_mxfp8(pool)  # one quantized copy of a shared pool
        mx = [(q, w, *(shared_mx or quantize_mxfp8(p)), table) for q, w, p, _ in calls]
        fn8 = jax.jit(
            lambda q, w, p, sc, t, kw=kw: indexer_topk(q, w, p, t, impl="pallas", k_scales=sc, sort=False, **kw)
        )
        ms = fresh_ms(fn8, mx)
        mx_bytes = mx[0][2].nbytes + mx[0][3].nbytes
        check = _same_topk(fn8(*mx[0])[0], ref_i)
        impl = "pallas scores (MXFP8 pool) + default selection"
        rows.append(row("indexer", shape, impl, ms, flops, mx_bytes, bw, rate, check))
        del draws, calls, mx, scores
    if prefill_len:
        t = prefill_len
        ks = jax.random.split(jax.random.key(t), 3)
        pool, table = _pool(ks[0], 1, t, dim, jnp.bfloat16)
        q = jax.random.normal(ks[1], (1, t, heads, dim), jnp.bfloat16)
        w = jax.random.normal(ks[2], (1, t, heads), jnp.float32)
        kw = dict(q_positions=jnp.arange(t, dtype=jnp.int32)[None], kv_lengths=jnp.array([t], jnp.int32), topk=topk,
                  scale=dim**-0.5)  # fmt: skip
        flops = 2 * t * (t + 1) / 2 * heads * dim
        shape = f"prefill T={t} heads={heads}x{dim} top-{topk}"
        cases = [("reference", {})] if prefill_reference else []
        cases += [("pallas", _prefill_variant(v)) for v in prefill_variants]
        first = None
        for impl, vk in cases:
            fn = jax.jit(lambda q, w, p, tb, impl=impl, vk=vk, kw=kw: indexer_topk(q, w, p, tb, impl=impl, **vk, **kw))
            got_i, _ = fn(q, w, pool, table)
            ms = median_ms(functools.partial(fn, q, w, pool, table), warmup=1, iters=3)
            if impl == "reference":
                label = "jnp reference (query blocks: scores + top_k)"
            else:
                tiles = f"tiled scores {vk['block_q']}x{vk['block_s']}"
                kernel = "one-query score kernel" if vk["block_q"] == 0 else tiles
                label = f"pallas {kernel} + {'selection kernel' if vk['select'] == 'kernel' else vk['select']}"
            check = "" if first is None else _same_topk(got_i[:, ::64], first[:, ::64])  # every 64th query
            first = got_i if first is None else first
            rows.append(row("indexer", shape, label, ms, flops, q.nbytes + pool.nbytes, bw, rate, check))
        rows += _prefill_parts(bw, rate, q, w, pool, table, kw, flops, shape, select_variants)
    return rows


# Score rows for `--topk-kinds`: what the split selection's candidate bounds meet besides the indexer's
# near-normal scores. Heavy tails and ties leave more than 2k candidates, which the best-first ranking cuts
# to k itself (each program's own K-th key search).
SPLIT_ROWS = {
    "normal": lambda key, shape: jax.random.normal(key, shape),
    "cauchy": lambda key, shape: jax.random.cauchy(key, shape),
    "ties": lambda key, shape: jnp.round(jax.random.normal(key, shape) * 2) / 2,
    "constant": lambda key, shape: jnp.ones(shape),
    # ReLU'd scores: ~0.6% positive, the K-th value a zero shared by the rest of the row
    "relu_zeros": lambda key, shape: jnp.maximum(jax.random.normal(key, shape) - 2.5, 0.0),
}


def _device_note(fn, calls) -> str:
    """The `fresh_ms` program's kernel span per call (no launch and wait), for the check column."""
    ms = fresh_device_ms(fn, calls)
    return "" if ms is None else f"device {ms:.4f} ms/call"


def _torch_topk_ms(xs, topk: int) -> tuple[float, np.ndarray] | None:
    """torch.topk over the same fresh inputs (the Top-K an inference server's sampler calls): CUDA-event ms per
    call of the calls queued back to back, median of 10, and the first call's positions; None without a CUDA
    torch."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    tx = [torch.from_numpy(np.asarray(x)).cuda() for x in xs]
    first = torch.topk(tx[0], topk, dim=-1).indices.cpu().numpy()
    times = []
    for _ in range(11):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for x in tx:
            torch.topk(x, topk, dim=-1)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / len(tx))
    return float(np.median(times[1:])), first


def topk_rows(bw, rate, kinds, row_counts, s, topk, chain=CHAIN) -> list[dict]:
    """Top-K of [R, S] float32 scores alone, for each score kind and row count R: `lax.top_k` (XLA), torch.topk,
    our selection kernel (one program per row), the split selection in position order and, up to
    RANK_MAX_ROWS rows, best first; the one the indexer picks for that shape is marked the default. Each
    timing runs `chain` calls on fresh scores (`common.fresh_ms`). Checks: best first equal to `lax.top_k`
    (values and positions), the others the same positions."""
    rows = []
    for kind, r in ((kind, r) for kind in kinds for r in row_counts):
        keys = jax.random.split(jax.random.key(s + r), chain)
        calls = [(SPLIT_ROWS[kind](k, (r, s)).astype(jnp.float32),) for k in keys]
        x = calls[0][0]
        shape = f"[{r}, {s}] {kind} scores, top-{topk}, {chain} calls, fresh inputs"
        picked = default_selection(r, s, topk)[0]
        default = picked, picked == "split" and r <= RANK_MAX_ROWS  # as `indexer_topk` ranks the split selection
        top = jax.jit(lambda x: jax.lax.top_k(x, topk))
        want_v, want_i = top(x)
        label = "lax.top_k (XLA)" + (" (the default)" if default == ("top_k", False) else "")
        rows.append(row("top-k", shape, label, fresh_ms(top, calls), 0, x.nbytes, bw, rate,
                        _device_note(top, calls)))  # fmt: skip
        torch_ms = _torch_topk_ms([c[0] for c in calls], topk)
        if torch_ms is not None:
            rows.append(row("top-k", shape, "torch.topk", torch_ms[0], 0, x.nbytes, bw, rate,
                            _same_topk(torch_ms[1], want_i)))  # fmt: skip
        for select, best_first in (("kernel", False), ("split", False), ("split", True)):
            if best_first and r > RANK_MAX_ROWS:
                continue
            fn = _selection(select, best_first, s, topk)
            vals, idx = fn(x)
            if best_first:
                same = np.array_equal(np.asarray(vals), np.asarray(want_v)) and np.array_equal(
                    np.asarray(idx), np.asarray(want_i)
                )
                check = "equal to lax.top_k" if same else "DIFFERS from lax.top_k"
            else:
                check = _same_topk(idx, want_i)
            label = {
                ("kernel", False): "selection kernel (one program per row)",
                ("split", False): "split selection, position order",
                ("split", True): "split selection, best first",
            }[select, best_first]
            label += " (the default)" if (select, best_first) == default else ""
            check = "; ".join(filter(None, [check, _device_note(fn, calls)]))
            rows.append(row("top-k", shape, label, fresh_ms(fn, calls), 0, x.nbytes, bw, rate, check))
        del calls
    return rows


def _prefill_parts(bw, rate, q, w, pool, table, kw, flops, shape, select_variants) -> list[dict]:
    """The prefill's two kernels alone: the tiled scores of the first query block, and the selection on
    those [T_block, S] scores with their causal prefixes (variants "chunk:warps:stages:digit_bits")."""
    from pallas_kernels._blocking import query_block_size
    from pallas_kernels.indexer.kernel import indexer_scores_tiled_pallas
    from pallas_kernels.paged import slot_index

    rows = []
    cpu = jax.default_backend() == "cpu"
    t = q.shape[1]
    tb = query_block_size(t, t)
    s_idx = jnp.arange(t, dtype=jnp.int32)[None]
    slots = slot_index(table, s_idx, PAGE)
    pos = kw["q_positions"][:, -tb:]  # the last block: the longest rows
    args = (q[:, -tb:], w[:, -tb:], pos, kw["kv_lengths"], slots, pool.reshape(-1, q.shape[-1]), None)
    scores_fn = jax.jit(
        lambda *a: indexer_scores_tiled_pallas(
            *a, scale=kw["scale"], block_q=64, block_k=128, precision="bf16", interpret=cpu
        )  # fmt: skip
    )
    scores = scores_fn(*args)
    part = f"{shape}, last {tb} queries"
    ms = median_ms(functools.partial(scores_fn, *args), warmup=1, iters=5)
    fl = 2 * tb * (t - tb / 2) * q.shape[2] * q.shape[3]
    rows.append(row("indexer", part, "tiled scores 64x128 alone", ms, fl, scores.nbytes, bw, rate))
    limits = (pos + 1).reshape(-1)
    flat = scores.reshape(-1, t)
    for variant in select_variants:
        chunk, warps, stages, bits, *pre = variant.split(":")
        chunk, warps, stages, bits = int(chunk), int(warps), int(stages), int(bits)
        pre = {"pre": True, "nopre": False}[pre[0]] if pre else None
        fn = jax.jit(
            lambda x, l, c=chunk, nw=warps, ns=stages, d=bits, p=pre: top_k_rows_pallas(
                x, l, k=kw["topk"], chunk=c, num_warps=nw, num_stages=ns, digit_bits=d, interpret=cpu, prefilter=p
            )
        )
        ms = median_ms(functools.partial(fn, flat, limits), warmup=1, iters=5)
        impl = f"selection kernel alone, chunk {chunk}, {warps} warps, {stages} stages, {bits}-bit digits"
        impl += {None: "", True: ", prefilter", False: ", no prefilter"}[pre]
        rows.append(row("indexer", part, impl, ms, 0, scores.nbytes, bw, rate))
    return rows


def _err_if_runs(fn, args, ref, what: str) -> float | None:
    """Relative error of fn(*args)[0] against ref, or None (and the reason printed) where the kernel does not
    run, e.g. a tile past the shared memory: the sweep goes on."""
    try:
        return rel_err(fn(*args)[0], ref)
    except jax.errors.JaxRuntimeError as e:
        print(f"  {what}: did not run: {str(e).splitlines()[0]}", flush=True)
        return None


def _mla_variant(text: str) -> tuple:
    """ "block_h:block_k:precision:splits:warps:stages" (splits "-" = the rule) -> a variant tuple."""
    bh, bk, prec, sp, nw, ns = text.split(":")
    return int(bh), int(bk), prec, None if sp == "-" else int(sp), int(nw), int(ns)


def _mla_work(idx, heads: int, lat: int, rope: int, s: int, row_bytes: int) -> tuple[float, float]:
    """(FLOPs, HBM bytes) a sparse MLA call must spend on `idx` [B, T, K] (-1 = no row): FLOPs 2·H·(2L + R) per
    selected row (an early causal query selects fewer than K); bytes the queries and outputs (bf16) and the
    selected rows of `row_bytes` read once each — per query at decode, where every step reads its rows anew,
    and each of the S pool rows once at prefill, where the queries of one call select from the same rows (a
    pool of a few MB stays in the L2 between them)."""
    b, t, _ = idx.shape
    per_seq = np.asarray(jnp.sum(idx >= 0, axis=(1, 2)))  # selected rows of each sequence's queries
    selected = int(per_seq.sum())
    rows_read = selected if t == 1 else int(np.minimum(per_seq, s).sum())
    io = b * t * heads * (2 * lat + rope) * 2
    return 2 * heads * (2 * lat + rope) * selected, io + rows_read * row_bytes


def _dispatched_ms(fn, *args, calls: int) -> float:
    """ms per call of `calls` separate dispatches of fn queued back to back (one wait), median of 10: nothing is
    shared between the calls, each pays its own launch."""
    return median_ms(functools.partial(fn, *args), warmup=2, iters=10, calls=calls)


def _measured_row(ctx, label, fn, args, nbytes, note="") -> dict:
    """One row of fn(*args): its time and error against the reference output, or a "did not run" row where it
    fails (the reason is printed). ctx = (case, shape, flops, bw, rate, reference output, timer, kernel note)."""
    case, shape, flops, bw, rate, ref, timer, kernels = ctx
    err = _err_if_runs(fn, args, ref, f"{case} | {shape} | {label}")
    if err is None:
        return row(case, shape, label, float("nan"), flops, nbytes, bw, rate, "did not run (see log)")
    ms, kn = timer(fn, *args), kernels(fn, *args)
    return row(case, shape, label, ms, flops, nbytes, bw, rate, f"rel err {err:.1e}{note}{kn}")


def sparse_mla_rows(
    bw,
    rate,
    batch,
    heads,
    lat,
    rope,
    topk,
    context,
    prefill_len,
    decode_variants=None,
    prefill_heads=(),
    chain=CHAIN,
) -> list[dict]:
    """Decode at `batch` x `heads`, prefill of `prefill_len` at `heads` and at each of `prefill_heads` (the
    latter: the default tiles and the old default only)."""
    rows = []
    main_heads = heads
    for case, b, t, s, heads, extra in (
        ("sparse MLA decode", batch, 1, context, main_heads, True),
        ("sparse MLA prefill", 1, prefill_len, prefill_len, main_heads, True),
        *(("sparse MLA prefill", 1, prefill_len, prefill_len, h, False) for h in prefill_heads if h != main_heads),
    ):
        if not t:
            continue
        ks = jax.random.split(jax.random.key(b * t), 4)
        pool, table = _pool(ks[0], b, s, lat + rope, jnp.bfloat16)
        ql = jax.random.normal(ks[1], (b, t, heads, lat), jnp.bfloat16)
        qr = jax.random.normal(ks[2], (b, t, heads, rope), jnp.bfloat16)
        # distinct causal positions per query (the last `topk` visible ones, scrambled)
        last = (s - t) + jnp.arange(t)[None, :, None]  # position of each query
        idx = last - jax.random.permutation(ks[3], jnp.arange(topk))[None, None, :]
        idx = jnp.where(idx >= 0, idx, -1).astype(jnp.int32)
        idx = jnp.broadcast_to(idx, (b, t, topk))
        flops, nbytes = _mla_work(idx, heads, lat, rope, s, (lat + rope) * 2)
        shape = f"B={b} T={t} heads={heads} L={lat} R={rope} top-{topk}"
        shape += f", {chain} separate dispatches" if t == 1 else ""
        timer = functools.partial(_dispatched_ms, calls=chain) if t == 1 else functools.partial(_single_ms, iters=5)
        kernels = functools.partial(_kernel_note, calls=chain) if t == 1 else lambda *a: ""

        ref = jax.jit(lambda a, c, p, tb, i: sparse_mla(a, c, p, tb, i, scale=0.1, impl="reference"))
        ref_o, _ = ref(ql, qr, pool, table, idx)
        if extra:
            ms = timer(ref, ql, qr, pool, table, idx)
            rows.append(row(case, shape, "jnp reference", ms, flops, nbytes, bw, rate))
        variants = [v + (4, 2) for v in MLA_VARIANTS + (MLA_DECODE_VARIANTS if t == 1 else ())]
        if t == 1 and decode_variants:
            variants = [_mla_variant(v) for v in decode_variants]
        if not extra:
            variants = [(16, 32, "bf16", None, 4, 2)]  # the default before `default_tiles`

        ctx = (case, shape, flops, bw, rate, ref_o, timer, kernels)
        measure = functools.partial(_measured_row, ctx)
        mla_args = (ql, qr, pool, table, idx)
        for bh, bk, prec, sp, nw, ns in [(None,) * 6, *variants]:
            kw = dict(
                scale=0.1, impl="pallas", block_h=bh, block_k=bk, precision=prec, splits=sp, num_warps=nw,
                num_stages=ns,
            )  # fmt: skip
            fn = jax.jit(lambda a, c, p, tb, i, kw=kw: sparse_mla(a, c, p, tb, i, **kw))
            label = f"pallas, block_h={bh}, block_k={bk}" + (f", {prec}" if prec != "tf32" else "")
            label += f", splits={sp}" if sp else ""
            label += f", {nw} warps, {ns} stages" if (nw, ns) != (4, 2) else ""
            if bh is not None:
                rows.append(measure(label, fn, mla_args, nbytes))
                continue
            dh, dk, dw, ds = default_tiles(heads, b * t, False)
            tiles = f"{dh} heads, {dk} rows, {dw} warps, {ds} stages, bf16"
            rows.append(measure(f"pallas, defaults ({tiles})", fn, mla_args, nbytes))
            # the grid order before heads_inner: the same kernel with the queries inner
            fn = jax.jit(lambda a, c, p, tb, i: sparse_mla(a, c, p, tb, i, scale=0.1, impl="pallas", heads_inner=False))
            rows.append(measure(f"pallas, defaults ({tiles}), queries-inner grid", fn, mla_args, nbytes))
            if is_sm90():  # the Mosaic GPU kernel ("auto"'s choice here)
                label = "mosaic (Mosaic GPU: cp.async gather warpgroup + 2 wgmma warpgroups, 64 heads)"
                fn = jax.jit(lambda a, c, p, tb, i: sparse_mla(a, c, p, tb, i, scale=0.1, impl="mosaic"))
                rows.append(measure(label, fn, mla_args, nbytes))
        if not extra:
            continue
        values, scales = quantize_kv_fp8(pool[..., :lat].astype(jnp.float32), 128)
        args = (ql, qr, values, scales, pool[..., lat:], table, idx)
        fp8_bytes = _mla_work(idx, heads, lat, rope, s, lat + 4 * lat // 128 + 2 * rope)[1]  # E4M3 + f32 scales
        pool_rows = pool.shape[0] * pool.shape[1]
        if dequantizes_pool(b * t, topk, pool_rows):  # prefill: the BF16 pool written and read back as well
            fp8_bytes = nbytes + values.nbytes + scales.nbytes + pool_rows * lat * 2
        for prec, label in ((None, "pallas, FP8 latent pool, defaults ({}, bf16)"),
                            ("tf32", "pallas, FP8 latent pool ({}), TF32 products")):  # fmt: skip
            how = "FP8-row kernel: {} heads, {} rows, {} warps, {} stages".format(
                *default_tiles(heads, b * t, True, precision=prec or "bf16")
            )
            if dequantizes_pool(b * t, topk, pool_rows):
                how = "pool dequantized once to bfloat16, then the BF16-row kernel"
            label = label.format(how)
            fp8 = jax.jit(
                lambda a, c, v8, sc, rp, tb, i, prec=prec: sparse_mla(
                    a, c, v8, tb, i, scale=0.1, impl="pallas", latent_scales=sc, rope_pages=rp, precision=prec
                )
            )
            rows.append(measure(label, fp8, args, fp8_bytes, " (FP8 rounding)"))
        if is_sm90():  # the Mosaic GPU kernel on the FP8 pool (see "auto"'s rule in sparse_attention/tuning.py)
            label = "mosaic, FP8 latent pool (" + (
                "pool dequantized once to bfloat16, then the BF16 Mosaic GPU kernel)"
                if dequantizes_pool(b * t, topk, pool_rows)
                else "Mosaic GPU: E4M3 rows gathered and converted to bf16 tiles by the producer warpgroup)"
            )
            fp8 = jax.jit(
                lambda a, c, v8, sc, rp, tb, i: sparse_mla(
                    a, c, v8, tb, i, scale=0.1, impl="mosaic", latent_scales=sc, rope_pages=rp
                )
            )
            rows.append(measure(label, fp8, args, fp8_bytes, " (FP8 rounding)"))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--contexts", type=int, nargs="*", default=[32768, 131072], help="none: no decode rows")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--index-heads", type=int, default=64)
    p.add_argument("--index-dim", type=int, default=128)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--indexer-prefill", type=int, default=32768, help="0 skips the indexer prefill row")
    p.add_argument("--mla-batch", type=int, default=64)
    p.add_argument("--mla-heads", type=int, default=128)
    p.add_argument("--mla-context", type=int, default=8192)
    p.add_argument("--mla-prefill", type=int, default=4096, help="0 skips the sparse MLA prefill row")
    p.add_argument(
        "--mla-prefill-heads", type=int, nargs="*", default=[16], help="more prefill rows (hybrid_small: 16)"
    )
    p.add_argument(
        "--indexer-variants", nargs="+", default=list(INDEXER_VARIANTS), help="BLOCK_S:KEYS_PER_PROGRAM:PRECISION"
    )
    p.add_argument(
        "--prefill-variants", nargs="+", default=list(PREFILL_VARIANTS), help="BLOCK_Q:BLOCK_S:SELECT (0: one-query)"
    )
    p.add_argument(
        "--select-variants",
        nargs="*",
        default=[],
        help="CHUNK:WARPS:STAGES:DIGIT_BITS[:pre|nopre] selection kernel alone at prefill (prefilter: the rule)",
    )
    p.add_argument(
        "--decode-selects", nargs="+", default=list(DECODE_SELECTS), help="default, top_k, split or kernel:SEGMENTS"
    )
    p.add_argument(
        "--topk-kinds", nargs="*", default=[], choices=sorted(SPLIT_ROWS),
        help="Top-K alone on [R, S] scores of each kind (S: the largest context), R each of --topk-rows",
    )  # fmt: skip
    p.add_argument("--topk-rows", type=int, nargs="+", default=[1, 64])
    p.add_argument("--no-prefill-reference", action="store_true", help="skip the jnp reference's prefill row")
    p.add_argument("--mla-decode-variants", nargs="*", default=None, help="BH:BK:PREC:SPLITS(-):WARPS:STAGES")
    p.add_argument("--only", choices=["indexer", "mla"], default=None, help="one kernel's rows only")
    p.add_argument(
        "--chain",
        type=int,
        default=CHAIN,
        help="sparse MLA decode: separate dispatches per timing",
    )
    p.add_argument("--fresh-calls", type=int, default=40, help="indexer / Top-K decode: calls on fresh inputs")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args()
    bw, rate = ceilings()
    print(f"measured ceilings: HBM {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
    rows = []
    if args.only != "mla":
        rows += indexer_rows(
            bw, rate, args.contexts, args.batches, args.index_heads, args.index_dim, args.topk, args.indexer_prefill,
            tuple(args.indexer_variants), tuple(args.prefill_variants), not args.no_prefill_reference,
            tuple(args.select_variants), tuple(args.decode_selects), args.fresh_calls,
        )  # fmt: skip
        if args.topk_kinds:
            s = max(args.contexts or [131072])
            rows += topk_rows(bw, rate, args.topk_kinds, args.topk_rows, s, args.topk, args.fresh_calls)
    if args.only != "indexer":
        rows += sparse_mla_rows(
            bw, rate, args.mla_batch, args.mla_heads, 512, 64, args.topk, args.mla_context, args.mla_prefill,
            args.mla_decode_variants, tuple(args.mla_prefill_heads), args.chain,
        )  # fmt: skip
    title = (
        f"Sparse-attention kernels; ceilings measured in this run: HBM {bw / 1e12:.2f} TB/s, "
        f"bf16 matmul {rate / 1e12:.0f} TFLOP/s"
    )
    report("sparse_attention.py", title, rows, record=not args.no_record)


if __name__ == "__main__":
    main()
