"""Public entry point of index-based sparse MLA."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._pallas import auto_impl, pow2
from pallas_kernels.paged import slot_index
from pallas_kernels.sparse_attention import hopper
from pallas_kernels.sparse_attention.kernel import sparse_mla_fp8_pallas, sparse_mla_pallas
from pallas_kernels.sparse_attention.reference import sparse_mla_reference

IMPLS = ("auto", "reference", "pallas", "hopper")

# Programs that keep the H200's 132 SMs busy. With few query rows (decode at a small batch) the kernel's
# grid (query rows x head blocks) has a handful of programs, each walking all top-k rows alone: hybrid_small
# batch 1 (16 heads, top-2048) ran one program, 179 us per layer (`benchmarks/profile_stage.py`). The
# selected rows are then split into independent parts merged by their log-sum-exp (flash-decoding).
TARGET_PROGRAMS = 128
MIN_ROWS_PER_SPLIT = 128
# 16-head blocks on BF16 rows at decode from WIDE_DECODE_ROWS query rows: 64 rows a step and twice the
# programs, which hide more of the gather latency (H200, 16 heads, top-2048 of 2112, block_k 64: B=64 0.072
# ms with 4 parts against 0.096 with 2, c8ddf8f). At B=16 (top-2048 of 4096) the narrower tile in 8 parts
# stayed faster (0.040 against 0.049 ms), at B=1 the two were within the spread between runs.
SMALL_BLOCK_TARGET_PROGRAMS = 256
WIDE_DECODE_ROWS = 64


# Query rows from which a launch has programs to spare (several per SM): 16-head blocks then run 2 warps.
MANY_ROWS = 1024

# An FP8 latent pool is dequantized whole (to the products' dtype) and read by the BF16-row kernel when the
# rows the kernel would convert (query rows x selected rows) number at least this many times the pool's
# rows: a prefill. E4M3 x a power-of-two scale is exact in bfloat16, so the products are those of the FP8
# kernel with bf16 products, summed in another order. Why: the FP8 kernel converts every gathered value in
# every program, and at prefill it was the slower one (H200, T=4096 x 16 heads, top-2048: 4.59 ms on FP8
# rows against 3.19 ms on BF16 rows, e10f145), while the pool is converted once, in one pass over it. At
# decode (B=64 x 2048 selected of 8192 rows each: ratio 0.25) the FP8 kernel reads half the bytes. The
# crossover itself is a cost estimate, not measured.
POOL_DEQUANT_MIN_RATIO = 8


def dequantizes_pool(query_rows: int, selected: int, pool_rows: int) -> bool:
    """Whether `sparse_mla(impl="pallas")` reads an FP8 latent pool through one dequantized copy (prefill)
    rather than converting the gathered rows in the FP8-row kernel: see POOL_DEQUANT_MIN_RATIO."""
    return query_rows * selected >= POOL_DEQUANT_MIN_RATIO * pool_rows


def _dequantized(values, scales, dtype):
    """[P,G,L] E4M3 values x [P,G,L/tile] scales -> [P,G,L] in dtype."""
    p, g, lat = values.shape
    tile = lat // scales.shape[-1]
    dense = values.astype(jnp.float32).reshape(p, g, -1, tile) * scales[..., None].astype(jnp.float32)
    return dense.reshape(p, g, lat).astype(dtype)


def hopper_unsupported(lat: int, rope: int, q_dtype, pool_dtype, fp8: bool, precision: str) -> str | None:
    """Why `hopper.sparse_mla_hopper` cannot run these shapes (None: it can). Heads are padded to 64 by the
    caller, so any head count runs; 64 heads a CTA waste the padding below 64 (see `prefers_hopper`)."""
    if fp8:
        return "an FP8 latent pool (the kernel gathers bfloat16 rows)"
    if precision != "bf16" or jnp.dtype(q_dtype) != jnp.bfloat16:
        return f"precision={precision!r} with {jnp.dtype(q_dtype).name} queries (it needs bf16 for both)"
    if jnp.dtype(pool_dtype) != jnp.bfloat16:
        return f"a {jnp.dtype(pool_dtype).name} pool (it needs bfloat16 rows)"
    if rope != hopper.TILE or lat % (2 * hopper.TILE):
        return f"latent {lat} / rope {rope} (it needs rope == {hopper.TILE} and latent a multiple of {2 * hopper.TILE})"
    return None


def prefers_hopper(n: int) -> bool:
    """Whether `impl="auto"` runs the Hopper kernel (when it can and the GPU is a Hopper): from 64 heads, at
    decode and prefill. Measured on the H200: decode B=64 x 128 heads, top-2048 of 8192, 40 chained calls:
    0.096-0.104 ms against 0.184-0.212 for the Triton kernel's defaults (b1ef719); prefill T=4096, top-2048:
    7.24 ms against 11.60 at 128 heads (dd438f2); at 16 heads, padded to 64, it was slower (4.08 vs 2.47 ms)."""
    return n >= hopper.BLOCK_H and _is_hopper()


def _is_hopper() -> bool:
    dev = jax.devices()[0]
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9.")


def default_tiles(
    heads: int, rows: int, fp8: bool, block_h: int | None = None, precision: str = "bf16"
) -> tuple[int, int, int, int]:
    """(block_h, block_k, num_warps, num_stages) measured fastest on the H200 (bf16 products; ad-hoc sweeps
    at aab90a2, BENCHMARKS.md notes of 2026-11-30), for `rows` query rows of `heads` heads; a given
    `block_h` picks the rest for that head block.

    - 32-head blocks (from 32 heads): 64 rows a step, 4 warps, 3 stages — decode B=64 x 128 heads,
      top-2048: 0.203-0.213 ms against 0.267-0.287 for (32 rows, 2 stages).
    - 16-head blocks: with MANY_ROWS query rows or more (prefill), 32 rows a step, 2 warps and 3 stages —
      T=4096 x 16 heads 2.67-2.72 ms against 3.75-3.85 for 4 warps, T=16384 7.0 against 10.3 ms; from
      WIDE_DECODE_ROWS (decode at a larger batch) 64 rows, 4 warps, 2 stages — 16 heads, top-2048 of 2112,
      c8ddf8f / 8686707: B=64 0.072-0.082 ms against 0.103-0.125 for 32 rows; else 32 rows, 4 warps, 2
      stages (B=16: 0.040 ms against 0.046-0.049 for 64 rows, 0.056 for 2 warps).
    - 64-head blocks: 64 rows, 8 warps, 2 stages (0.244 ms at the decode shape above).
    - FP8 latent rows (bf16 products; ad-hoc sweep at e10f145, BENCHMARKS.md notes of 2026-11-30): 64-head
      blocks from 64 heads, 64 rows, 8 warps, 2 stages — decode B=64 x 128 heads: 0.468 ms against 0.508
      for (32, 64, 4, 2) and 0.683 for (16, 32, 4, 2); 32-head blocks (32, 64, 4, 2); 16-head blocks 32 rows,
      4 warps, 2 stages (prefill T=4096 x 16 heads: 4.59 ms, the fastest of five tiles).
    - float32 operands (precision "tf32" or "ieee": float32 queries) from 32-head blocks, on either pool:
      32-head blocks, 32 rows a step, 2 stages. The tiles above hold twice the bytes per gathered tile
      there: on FP8 rows the 64-head tile asked for 238,848 bytes of the H200's 232,448 of shared memory
      (the kernel did not run), and the fitting ones ran slower (H200, d397dea, float32 queries, 128 heads,
      top-2048: decode B=64 BF16 rows 0.511 ms against 0.822 for (32, 64, 4, 3), FP8 rows 0.693 against
      1.110 for (32, 64, 4, 2); prefill T=4096 28.5 ms against 41.4). 16-head blocks: 32 rows a step too
      at decode — (16, 64, 4, 2) ran on the H200 (B=64, 0.116 ms) but the host compile of
      `benchmarks/kernel_resources.py` puts it at 250,112 bytes, so its fit rests on XLA's Triton version —
      and the prefill rule above (T=4096 6.9 ms).
    """
    if precision != "bf16" and (block_h or heads) >= 32:
        block_h = block_h or 32
        return block_h, 32, 4 if block_h <= 32 else 8, 2
    if precision != "bf16" and not fp8 and rows < MANY_ROWS:
        return block_h or 16, 32, 4, 2
    if fp8:
        block_h = block_h or (64 if heads >= 64 else 32 if heads >= 32 else 16)
        if block_h >= 64:
            return block_h, 64, 8, 2
        return (block_h, 64, 4, 2) if block_h >= 32 else (block_h, 32, 4, 2)
    if block_h is None:
        block_h = 32 if heads >= 32 else 16
    if block_h >= 64:
        return block_h, 64, 8, 2
    if block_h >= 32:
        return block_h, 64, 4, 3
    if rows >= MANY_ROWS:
        return block_h, 32, 2, 3
    return (block_h, 64, 4, 2) if rows >= WIDE_DECODE_ROWS else (block_h, 32, 4, 2)


def num_splits(programs: int, rows: int, block_k: int, target: int = TARGET_PROGRAMS) -> int:
    """Parts the `rows` selected rows go in: a power of two that brings `programs` near `target`, each part
    a whole number of `block_k` blocks and at least MIN_ROWS_PER_SPLIT rows."""
    s = 1
    while programs * s * 2 <= target and rows % (s * 2 * block_k) == 0 and rows // (s * 2) >= MIN_ROWS_PER_SPLIT:
        s *= 2
    return s


def merge_splits(out, lse):
    """out [R,S,N,L] (each part softmax-normalised over its rows), lse [R,S,N] -> ([R,N,L] float32, [R,N])."""
    m = jnp.max(lse, axis=1, keepdims=True)
    m = jnp.where(jnp.isneginf(m), 0.0, m)  # a row with nothing selected: weights 0, lse -inf
    w = jnp.exp(lse - m)  # [R,S,N]
    total = jnp.sum(w, axis=1)
    o = jnp.einsum("rsn,rsnl->rnl", w, out.astype(jnp.float32)) / jnp.where(total > 0, total, 1.0)[..., None]
    return o, jnp.log(total) + m[:, 0]


def _pool_slots(page_table, indices, page_size: int, kp: int):
    """Pool rows of the selected positions [B,T,K] -> [B*T, kp]; -1 stays -1, and the padding adds more."""
    b, t, k = indices.shape
    slots = jnp.where(indices >= 0, slot_index(page_table, jnp.maximum(indices, 0), page_size), -1)
    return jnp.pad(slots.reshape(b * t, k), [(0, 0), (0, kp - k)], constant_values=-1).astype(jnp.int32)


def _flat_queries(q_latent, q_rope, np_: int):
    """[B,T,N,L] and [B,T,N,R] -> [B*T, np_, L] and [B*T, np_, R], heads zero-padded to np_ (a whole number
    of the kernel's head blocks)."""
    b, t, n = q_latent.shape[:3]
    heads = [(0, 0), (0, np_ - n), (0, 0)]
    return tuple(jnp.pad(q.reshape(b * t, n, q.shape[-1]), heads) for q in (q_latent, q_rope))


def _check_splits(sp: int, kp: int, block_k: int) -> int:
    if sp < 1 or kp % (sp * block_k):
        raise ValueError(f"sparse_mla: splits={sp} must divide the {kp // block_k} blocks of {block_k} selected rows")
    return sp


def _unflat(out, lse, sp: int, q_latent):
    """The kernel's [B*T*sp, np_, L] / [B*T*sp, np_] -> [B,T,N,L] / [B,T,N]: parts merged by LSE, heads unpadded."""
    b, t, n, lat = q_latent.shape
    np_ = out.shape[1]
    if sp > 1:
        out, lse = merge_splits(out.reshape(b * t, sp, np_, lat), lse.reshape(b * t, sp, np_))
        out = out.astype(q_latent.dtype)
    return out[:, :n].reshape(b, t, n, lat), lse[:, :n].reshape(b, t, n)


def _sparse_mla_hopper(q_latent, q_rope, kv_pages, page_table, indices, scale, rope_pages, splits):
    """`hopper.sparse_mla_hopper` over the pool: heads padded to 64, selected rows to a multiple of 64, the
    rows split into parts merged by LSE when the grid would leave SMs idle (`num_splits`)."""
    b, t, n = q_latent.shape[:3]
    k = indices.shape[-1]
    bh, bk = hopper.BLOCK_H, hopper.BLOCK_K
    kp, np_ = -(-k // bk) * bk, -(-n // bh) * bh
    slots = _pool_slots(page_table, indices, kv_pages.shape[1], kp)
    sp = _check_splits(num_splits(b * t * (np_ // bh), kp, bk) if splits is None else splits, kp, bk)
    ql, qr = _flat_queries(q_latent, q_rope, np_)
    pools = (kv_pages.reshape(-1, kv_pages.shape[-1]),)
    pools += () if rope_pages is None else (rope_pages.reshape(-1, rope_pages.shape[-1]),)
    slots = slots.reshape(b * t * sp, kp // sp)
    out, lse = hopper.sparse_mla_hopper(ql, qr, slots, *pools, scale=float(scale), q_splits=sp)
    return _unflat(out, lse, sp, q_latent)


def sparse_mla(
    q_latent,
    q_rope,
    kv_pages,
    page_table,
    indices,
    *,
    scale: float,
    impl: str = "auto",
    block_h: int | None = None,
    block_k: int | None = None,
    splits: int | None = None,
    precision: str | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool | None = None,
    latent_scales=None,
    rope_pages=None,
    heads_inner: bool = True,
):
    """Absorbed-form MLA over selected positions.

    q_latent [B,T,N,L] (W_UK already absorbed), q_rope [B,T,N,R], kv_pages [P,G,L+R] latent pool,
    page_table [B,n], indices [B,T,K] int32 positions (-1 = unused).
    Returns (out [B,T,N,L] in q_latent.dtype, natural-log LSE [B,T,N] float32, -inf where nothing is selected).
    impl: "reference" (jnp), "pallas" (`kernel.sparse_mla_pallas`: rows gathered from the pool inside the
    kernel, online softmax; L and R powers of two; `block_h` heads, `block_k` rows per step, `num_warps`
    and `num_stages` — each left None is taken from `default_tiles` (measured on the H200 per pool, head
    count, query rows and operand precision), `precision`
    "tf32", "ieee" or "bf16" (bfloat16 operands and probabilities, float32 accumulation, flash-attention
    style; on an FP8 pool the E4M3 values enter the products as bfloat16, exactly) for its products —
    default "bf16" for bf16 queries, on BF16 and FP8 pools alike (H200, B=64 x 128 heads, top-2048, 10
    chained calls: 0.278 ms vs 0.495 ms TF32 at 32f2129; FP8 pool 0.759 vs 0.900 ms, prefill T=4096 33.9
    vs 42.3 ms at e10f145; BENCHMARKS.md), else "tf32" — `interpret`
    default on CPU; `splits` parts of the selected rows run as separate programs and are merged by LSE —
    default `num_splits`: more than one only when the grid would be small, i.e. decode at a small batch), or
    "hopper" (`hopper.sparse_mla_hopper`, Pallas Mosaic GPU for sm_90: a `cp.async` gather warpgroup and two
    `wgmma` warpgroups, 64 heads a CTA, 64 selected rows a step, at decode and prefill; bf16 queries and BF16
    pool(s), R == 64, L a multiple of 128; tile knobs do not apply; `splits` as above; a clear error otherwise) or
    "auto" (Pallas on GPU when L and R are powers of two with R >= 16 — 4-12x the reference on the H200,
    BENCHMARKS.md — and there "hopper" where `prefers_hopper` and no tile knob is given; else the reference).
    Split pools: pass `kv_pages` = the latent pool [P,G,L] and `rope_pages` [P,G,R] (the model's cache keeps
    them apart; the kernel reads both, so no step concatenates the pools). FP8 latent cache: in addition
    `latent_scales` [P,G,L/tile] float32 with `kv_pages` in E4M3; the Pallas kernel dequantizes the selected
    rows in the kernel, the reference dequantizes the pool first — and so does the Pallas path at prefill
    (query rows x selected rows >= POOL_DEQUANT_MIN_RATIO x the pool's rows), to bfloat16 (float32 for "ieee"),
    then runs the BF16-row kernel.
    `heads_inner` orders the kernel's grid with the head blocks of a query next to each other (they start
    together and share the query's gathered rows through L2); False puts the queries inner, as before.
    """
    if impl not in IMPLS:
        raise ValueError(f"sparse_mla: unknown impl={impl!r}; expected one of {IMPLS}")
    if precision is None:  # as precise as the queries (E4M3 -> bfloat16 is exact: FP8 rows lose nothing)
        precision = "bf16" if jnp.dtype(q_latent.dtype) == jnp.bfloat16 else "tf32"
    if precision not in ("tf32", "ieee", "bf16"):
        raise ValueError(f"sparse_mla: precision={precision!r} must be 'tf32', 'ieee' or 'bf16'")
    if latent_scales is not None and rope_pages is None:
        raise ValueError("sparse_mla: an FP8 latent pool (latent_scales) needs its rope pool (rope_pages)")
    b, t, n, lat = q_latent.shape
    rope = q_rope.shape[-1]
    want = (lat,) if rope_pages is not None else (lat + rope,)
    if kv_pages.shape[-1:] != want or (rope_pages is not None and rope_pages.shape[-1] != rope):
        got = kv_pages.shape[-1] if rope_pages is None else (kv_pages.shape[-1], rope_pages.shape[-1])
        raise ValueError(f"sparse_mla: pool width {got} does not match latent {lat} + rope {rope}")
    supported = lat == pow2(lat) and rope == pow2(rope) and rope >= 16
    fp8 = latent_scales is not None
    why_not_hopper = hopper_unsupported(lat, rope, q_latent.dtype, kv_pages.dtype, fp8, precision)
    if impl == "auto":
        impl = "pallas" if auto_impl("sparse_mla", supported) else "reference"
        tiles_given = any(v is not None for v in (block_h, block_k, num_warps, num_stages))
        if impl == "pallas" and why_not_hopper is None and not tiles_given and prefers_hopper(n):
            impl = "hopper"
    if impl == "hopper":
        if why_not_hopper is not None:
            raise ValueError(f"sparse_mla(impl='hopper'): the kernel cannot run {why_not_hopper}")
        if not _is_hopper():
            dev = jax.devices()[0]
            raise ValueError(
                f"sparse_mla(impl='hopper') needs a Hopper (sm_90) GPU; the first device is {dev.device_kind!r} "
                f"on {dev.platform!r}"
            )
        return _sparse_mla_hopper(q_latent, q_rope, kv_pages, page_table, indices, scale, rope_pages, splits)
    if impl != "pallas":
        if latent_scales is not None:
            kv_pages = _dequantized(kv_pages, latent_scales, jnp.float32)
        if rope_pages is not None:
            dt = jnp.promote_types(kv_pages.dtype, rope_pages.dtype)
            kv_pages = jnp.concatenate([kv_pages.astype(dt), rope_pages.astype(dt)], axis=-1)
        return sparse_mla_reference(q_latent, q_rope, kv_pages, page_table, indices, scale=scale)
    if not supported:
        raise ValueError(f"sparse_mla(impl='pallas'): latent {lat} and rope {rope} must be powers of two (rope >= 16)")
    k = indices.shape[-1]
    if latent_scales is not None and dequantizes_pool(b * t, k, kv_pages.shape[0] * kv_pages.shape[1]):
        # bfloat16 unless "ieee": E4M3 times a power-of-two scale (`quantize_kv_fp8`'s) is exact in it, and
        # float32 rows made the kernel 21x slower (H200, d397dea, T=4096 x 128 heads, same tiles: 876 vs 41 ms)
        kv_pages = _dequantized(kv_pages, latent_scales, jnp.float32 if precision == "ieee" else jnp.bfloat16)
        latent_scales = None
    tiles = default_tiles(n, b * t, latent_scales is not None, block_h, precision)
    block_h, block_k, num_warps, num_stages = (
        tiles[i] if given is None else given for i, given in enumerate((block_h, block_k, num_warps, num_stages))
    )
    kp = -(-k // block_k) * block_k
    np_ = -(-n // block_h) * block_h
    slots = _pool_slots(page_table, indices, kv_pages.shape[1], kp)
    kw = dict(
        scale=float(scale), block_h=block_h, block_k=block_k, precision=precision, num_warps=num_warps,
        num_stages=num_stages, interpret=jax.default_backend() == "cpu" if interpret is None else interpret,
        heads_inner=heads_inner,
    )  # fmt: skip
    ql, qr = _flat_queries(q_latent, q_rope, np_)
    wide = block_h <= 16 and latent_scales is None and WIDE_DECODE_ROWS <= b * t < MANY_ROWS
    target = SMALL_BLOCK_TARGET_PROGRAMS if wide else TARGET_PROGRAMS
    sp = num_splits(b * t * (np_ // block_h), kp, block_k, target) if splits is None else splits
    sp = _check_splits(sp, kp, block_k)
    if sp > 1:  # a program per query and part, each part with its own rows (the kernel reads query r // sp)
        slots = slots.reshape(b * t * sp, kp // sp)
    kw["q_splits"] = sp
    if latent_scales is None:
        rope_rows = None if rope_pages is None else rope_pages.reshape(-1, rope)
        out, lse = sparse_mla_pallas(
            ql, qr, slots.astype(jnp.int32), kv_pages.reshape(-1, kv_pages.shape[-1]), rope_rows, **kw
        )
    else:
        out, lse = sparse_mla_fp8_pallas(
            ql, qr, slots.astype(jnp.int32), kv_pages.reshape(-1, lat),
            latent_scales.reshape(-1, latent_scales.shape[-1]).astype(jnp.float32), rope_pages.reshape(-1, rope), **kw,
        )  # fmt: skip
    return _unflat(out, lse, sp, q_latent)
