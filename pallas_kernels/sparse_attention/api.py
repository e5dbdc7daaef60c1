"""Public entry point of index-based sparse MLA."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import registry
from pallas_kernels.paged import dequantized, merge_splits, slot_index
from pallas_kernels.sparse_attention import mosaic_gpu
from pallas_kernels.sparse_attention.kernel import sparse_mla_fp8_pallas, sparse_mla_pallas
from pallas_kernels.sparse_attention.reference import sparse_mla_reference
from pallas_kernels.sparse_attention.tuning import (
    BF16_TILES,
    BF16_TILES_16,
    F32_BLOCK_K,
    F32_STAGES,
    FP8_TILES,
    MANY_ROWS,
    MIN_ROWS_PER_SPLIT,
    POOL_DEQUANT_MIN_RATIO,
    SMALL_BLOCK_TARGET_PROGRAMS,
    TARGET_PROGRAMS,
    WIDE_DECODE_ROWS,
)


def dequantizes_pool(query_rows: int, selected: int, pool_rows: int) -> bool:
    """Whether `sparse_mla(impl="pallas")` reads an FP8 latent pool through one dequantized copy (prefill)
    rather than converting the gathered rows in the FP8-row kernel (`tuning.POOL_DEQUANT_MIN_RATIO`)."""
    return query_rows * selected >= POOL_DEQUANT_MIN_RATIO * pool_rows


def default_tiles(
    heads: int, rows: int, fp8: bool, block_h: int | None = None, precision: str = "bf16"
) -> tuple[int, int, int, int]:
    """(block_h, block_k, num_warps, num_stages) of the Triton kernel from `tuning`'s tables, for `rows` query
    rows of `heads` heads on a BF16 or FP8 (`fp8`) pool; a given `block_h` picks the rest for that head block.
    float32 operands ("tf32" / "ieee") take the narrower F32 tiles wherever the head block is 32 or more, and
    at decode on a BF16 pool."""
    if precision != "bf16" and (block_h or heads) >= 32:
        block_h = block_h or 32
        return block_h, F32_BLOCK_K, 4 if block_h <= 32 else 8, F32_STAGES
    if precision != "bf16" and not fp8 and rows < MANY_ROWS:
        return block_h or 16, F32_BLOCK_K, 4, F32_STAGES
    if fp8:
        block_h = block_h or (64 if heads >= 64 else 32 if heads >= 32 else 16)
        return (block_h, *FP8_TILES[min(64, max(16, block_h))])
    block_h = block_h or (32 if heads >= 32 else 16)
    if block_h >= 32:
        return (block_h, *BF16_TILES[min(64, block_h)])
    kind = "prefill" if rows >= MANY_ROWS else "wide" if rows >= WIDE_DECODE_ROWS else "decode"
    return (block_h, *BF16_TILES_16[kind])


def num_splits(programs: int, rows: int, block_k: int, target: int = TARGET_PROGRAMS) -> int:
    """Parts the `rows` selected rows go in: a power of two that brings `programs` near `target`, each part
    a whole number of `block_k` blocks and at least MIN_ROWS_PER_SPLIT rows."""
    s = 1
    while programs * s * 2 <= target and rows % (s * 2 * block_k) == 0 and rows // (s * 2) >= MIN_ROWS_PER_SPLIT:
        s *= 2
    return s


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


def _sparse_mla_mosaic(q_latent, q_rope, kv_pages, page_table, indices, scale, rope_pages, splits, latent_scales):
    """`mosaic_gpu.sparse_mla_mosaic` over the pool: heads padded to 64, selected rows to a multiple of 64,
    the rows split into parts merged by LSE when the grid would leave SMs idle (`num_splits`). An FP8 latent
    pool is read as E4M3 rows (converted in the kernel) unless the call reads enough rows to dequantize the
    pool once (`dequantizes_pool`: a prefill), as on the Pallas path."""
    b, t, n = q_latent.shape[:3]
    k = indices.shape[-1]
    if rope_pages is not None and not rope_pages.shape[-1]:  # NoPE: a zero-width rope pool has nothing to read
        rope_pages = None
    if latent_scales is not None and dequantizes_pool(b * t, k, kv_pages.shape[0] * kv_pages.shape[1]):
        kv_pages, latent_scales = dequantized(kv_pages, latent_scales, jnp.bfloat16), None
    bh, bk = mosaic_gpu.BLOCK_H, mosaic_gpu.BLOCK_K
    kp, np_ = -(-k // bk) * bk, -(-n // bh) * bh
    slots = _pool_slots(page_table, indices, kv_pages.shape[1], kp)
    sp = _check_splits(num_splits(b * t * (np_ // bh), kp, bk) if splits is None else splits, kp, bk)
    ql, qr = _flat_queries(q_latent, q_rope, np_)
    pools = (kv_pages.reshape(-1, kv_pages.shape[-1]),)
    pools += () if rope_pages is None else (rope_pages.reshape(-1, rope_pages.shape[-1]),)
    slots = slots.reshape(b * t * sp, kp // sp)
    scales = None if latent_scales is None else latent_scales.reshape(-1, latent_scales.shape[-1])
    out, lse = mosaic_gpu.sparse_mla_mosaic(ql, qr, slots, *pools, lat_scales=scales, scale=float(scale), q_splits=sp)
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
    """Absorbed-form MLA over selected positions:
    logit[n, s] = scale (q_latent[n] · c_s + q_rope[n] · k_rope_s) over the selected s,
    out[n] = Σ_s softmax(logit[n])_s c_s, lse[n] = log Σ_s exp(logit[n, s]).

    q_latent [B,T,N,L] (W_UK already absorbed), q_rope [B,T,N,R], kv_pages [P,G,L+R] latent pool,
    page_table [B,n], indices [B,T,K] int32 positions (-1 = unused).
    Returns (out [B,T,N,L] in q_latent.dtype, natural-log LSE [B,T,N] float32, -inf where nothing is selected).

    impl (see `pallas_kernels.registry`):
    - "reference": jnp (`reference.sparse_mla_reference`);
    - "pallas": `kernel.sparse_mla_pallas`, rows gathered from the pool inside the kernel, online softmax; L and
      R powers of two (R >= 16, or R = 0: no rope part). Tiles `block_h` heads x `block_k` rows a step,
      Triton's `num_warps` / `num_stages`: each left None comes from `default_tiles`. `precision` of the
      products: "bf16" (bfloat16 operands and probabilities, float32 accumulation; on an FP8 pool the E4M3
      values enter exactly), "tf32" or "ieee"; default "bf16" for bf16 queries, else "tf32";
    - "mosaic": `mosaic_gpu.sparse_mla_mosaic`, Pallas Mosaic GPU for sm_90 (a `cp.async` gather warpgroup
      and two `wgmma` warpgroups, 64 heads a CTA); bf16 queries, a BF16 pool or an FP8 latent pool with a scale
      every 128 columns (its gather warpgroup converts the E4M3 rows to bf16 tiles), R == 64 or 0, L a multiple
      of 128; the tile knobs do not apply;
    - "auto": `registry.resolve("sparse_mla", ...)`.
    `splits`: parts of the selected rows run as separate programs and merged by LSE (default `num_splits`:
    more than one only when the grid would be small, i.e. decode at a small batch). `interpret`: default on
    a CPU.
    Split pools: `kv_pages` = the latent pool [P,G,L] and `rope_pages` [P,G,R] (the model's cache keeps them
    apart; the kernels read both, so no step concatenates the pools). FP8 latent cache: in addition
    `latent_scales` [P,G,L/tile] float32 with `kv_pages` in E4M3; the Pallas kernel dequantizes the selected
    rows, the reference the pool first — as does the Pallas path at prefill (`dequantizes_pool`), to bfloat16
    (float32 for "ieee"), then the BF16-row kernel runs.
    `heads_inner` orders the kernel's grid with the head blocks of a query next to each other (they start
    together and share the query's gathered rows through L2); False puts the queries inner.
    """
    registry.check_impl("sparse_mla", impl)
    if precision is None:  # as precise as the queries (E4M3 -> bfloat16 is exact: FP8 rows lose nothing)
        precision = "bf16" if jnp.dtype(q_latent.dtype) == jnp.bfloat16 else "tf32"
    if precision not in ("tf32", "ieee", "bf16"):
        raise ValueError(f"sparse_mla: precision={precision!r} must be 'tf32', 'ieee' or 'bf16'")
    b, t, n, lat = q_latent.shape
    rope = q_rope.shape[-1]
    if latent_scales is not None and rope_pages is None and rope:
        raise ValueError("sparse_mla: an FP8 latent pool (latent_scales) needs its rope pool (rope_pages)")
    want = (lat,) if rope_pages is not None else (lat + rope,)
    if kv_pages.shape[-1:] != want or (rope_pages is not None and rope_pages.shape[-1] != rope):
        got = kv_pages.shape[-1] if rope_pages is None else (kv_pages.shape[-1], rope_pages.shape[-1])
        raise ValueError(f"sparse_mla: pool width {got} does not match latent {lat} + rope {rope}")
    fp8 = latent_scales is not None
    if fp8 and (latent_scales.shape[:-1] != kv_pages.shape[:-1] or not latent_scales.shape[-1]
                or lat % latent_scales.shape[-1]):  # fmt: skip
        raise ValueError(
            f"sparse_mla: latent_scales {tuple(latent_scales.shape)} must be the latent pool's "
            f"{tuple(kv_pages.shape[:-1])} x a divisor of the latent width {lat}"
        )
    facts = dict(
        heads=n, latent=lat, rope=rope, q_dtype=q_latent.dtype, pool_dtype=kv_pages.dtype, fp8=fp8,
        precision=precision, tiles_given=any(v is not None for v in (block_h, block_k, num_warps, num_stages)),
        fp8_tile=lat // latent_scales.shape[-1] if fp8 else None,
        rope_dtype=None if rope_pages is None or not rope else rope_pages.dtype,
        fp8_rows=fp8 and not dequantizes_pool(b * t, indices.shape[-1], kv_pages.shape[0] * kv_pages.shape[1]),
    )  # fmt: skip
    impl = registry.resolve("sparse_mla", impl, **facts).impl
    if impl == "mosaic":
        why_not = registry.mosaic_sparse_unsupported(**facts)
        if why_not is not None:
            raise ValueError(f"sparse_mla(impl='mosaic'): the kernel cannot run {why_not}")
        if not registry.is_sm90():
            dev = jax.devices()[0]
            raise ValueError(
                f"sparse_mla(impl='mosaic') needs a Hopper (sm_90) GPU; the first device is {dev.device_kind!r} "
                f"on {dev.platform!r}"
            )
        return _sparse_mla_mosaic(
            q_latent, q_rope, kv_pages, page_table, indices, scale, rope_pages, splits, latent_scales
        )
    if impl != "pallas":
        if latent_scales is not None:
            kv_pages = dequantized(kv_pages, latent_scales, jnp.float32)
        if rope_pages is not None:
            dt = jnp.promote_types(kv_pages.dtype, rope_pages.dtype)
            kv_pages = jnp.concatenate([kv_pages.astype(dt), rope_pages.astype(dt)], axis=-1)
        return sparse_mla_reference(q_latent, q_rope, kv_pages, page_table, indices, scale=scale)
    why_not = registry.TABLE["sparse_mla"].unsupported(**facts)
    if why_not is not None:
        raise ValueError(f"sparse_mla(impl='pallas'): {why_not}")
    k = indices.shape[-1]
    if latent_scales is not None and dequantizes_pool(b * t, k, kv_pages.shape[0] * kv_pages.shape[1]):
        # bfloat16 unless "ieee": E4M3 times a power-of-two scale (`quantize_kv_fp8`'s) is exact in it, and
        # float32 rows would double the bytes of every gathered tile
        kv_pages = dequantized(kv_pages, latent_scales, jnp.float32 if precision == "ieee" else jnp.bfloat16)
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
        num_stages=num_stages, interpret=registry.interpret_default(interpret),
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
            latent_scales.reshape(-1, latent_scales.shape[-1]).astype(jnp.float32),
            None if rope_pages is None else rope_pages.reshape(-1, rope), **kw,
        )  # fmt: skip
    return _unflat(out, lse, sp, q_latent)
