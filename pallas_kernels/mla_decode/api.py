"""Public entry point of dense MLA decode over the paged pools."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import registry
from pallas_kernels.mla_decode.kernel import mla_decode_pallas
from pallas_kernels.mla_decode.reference import mla_decode_reference
from pallas_kernels.mla_decode.tuning import BF16_TILES, F32_TILES, MAX_SPLITS, TARGET_PROGRAMS
from pallas_kernels.paged import merge_splits


def default_tiles(rows: int, precision: str) -> tuple[int, int, int, int]:
    """(block_h, block_k, num_warps, num_stages) for `rows` query rows (T x N) of one sequence."""
    block_h = 64 if rows >= 64 else 32 if rows >= 32 else 16
    return (block_h, *(BF16_TILES if precision == "bf16" else F32_TILES)[block_h])


def default_splits(programs: int, span_blocks: int) -> int:
    """Splits of each sequence's context so that `programs` (head blocks x sequences) x splits is near
    TARGET_PROGRAMS, at most MAX_SPLITS and at most the blocks the cache can hold."""
    return max(1, min(TARGET_PROGRAMS // max(programs, 1), MAX_SPLITS, span_blocks))


def mla_decode(
    q_latent,
    q_rope,
    kv_pages,
    page_table,
    *,
    q_positions,
    kv_lengths,
    scale: float,
    rope_pages=None,
    latent_scales=None,
    impl: str = "auto",
    block_h: int | None = None,
    block_k: int | None = None,
    splits: int | None = None,
    precision: str | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool | None = None,
):
    """Dense MLA of a few queries per sequence (decode, speculative verify) over the paged cache, absorbed form:
    logit[n, s] = scale (q_latent[n] · c_s + q_rope[n] · k_rope_s) over the positions s <= q_positions[b, t],
    s < kv_lengths[b]; out[n] = Σ_s softmax(logit[n])_s c_s; lse[n] = log Σ_s exp(logit[n, s]).

    q_latent [B,T,N,L] (W_UK absorbed), q_rope [B,T,N,R] (R may be 0), kv_pages [P,G,L] latent pool and
    rope_pages [P,G,R] (or one pool [P,G,L+R] with rope_pages None), latent_scales [P,G,L/tile] float32 for an
    E4M3 latent pool, page_table [B,n] int32, q_positions [B,T] int32, kv_lengths [B] int32.
    Returns (out [B,T,N,L] in q_latent.dtype, natural-log LSE [B,T,N] float32; a query that sees nothing: 0,
    -inf).

    impl (see `pallas_kernels.registry`): "reference" (`reference.mla_decode_reference`: each sequence's pages
    gathered into one copy), "pallas" (`kernel.mla_decode_pallas`: the pools read in place, the context split
    over `splits` programs per sequence at run time and the parts merged by LSE; L and R powers of two, R = 0
    or >= 16), "auto". Tiles (`block_h` query rows x `block_k` positions, Triton's `num_warps` /
    `num_stages`) and `splits` left None come from `tuning`. `precision` of the kernel's products: "bf16"
    (default for bf16 queries), "tf32" (default otherwise) or "ieee". `interpret`: default on a CPU.
    """
    registry.check_impl("mla_decode", impl)
    if precision is None:
        precision = "bf16" if jnp.dtype(q_latent.dtype) == jnp.bfloat16 else "tf32"
    if precision not in ("bf16", "tf32", "ieee"):
        raise ValueError(f"mla_decode: precision={precision!r} must be 'bf16', 'tf32' or 'ieee'")
    b, t, n, lat = q_latent.shape
    rope = q_rope.shape[-1]
    want = (lat,) if rope_pages is not None or latent_scales is not None else (lat + rope,)
    if kv_pages.shape[-1:] != want or (rope_pages is not None and rope_pages.shape[-1] != rope):
        got = kv_pages.shape[-1] if rope_pages is None else (kv_pages.shape[-1], rope_pages.shape[-1])
        raise ValueError(f"mla_decode: pool width {got} does not match latent {lat} + rope {rope}")
    if latent_scales is not None and rope and rope_pages is None:
        raise ValueError("mla_decode: an FP8 latent pool (latent_scales) needs its rope pool (rope_pages)")
    if q_positions.shape != (b, t) or kv_lengths.shape != (b,):
        raise ValueError(
            f"mla_decode: q_positions {q_positions.shape} / kv_lengths {kv_lengths.shape} must be {(b, t)} / {(b,)}"
        )
    impl = registry.resolve("mla_decode", impl, latent=lat, rope=rope, rows=t * n).impl
    if impl != "pallas":
        return mla_decode_reference(
            q_latent, q_rope, kv_pages, page_table, q_positions=q_positions, kv_lengths=kv_lengths, scale=scale,
            rope_pages=rope_pages, latent_scales=latent_scales,
        )  # fmt: skip
    why_not = registry.TABLE["mla_decode"].unsupported(latent=lat, rope=rope, rows=t * n)
    if why_not is not None:
        raise ValueError(f"mla_decode(impl='pallas'): {why_not}")
    tiles = default_tiles(t * n, precision)
    block_h, block_k, num_warps, num_stages = (
        tiles[i] if given is None else given for i, given in enumerate((block_h, block_k, num_warps, num_stages))
    )
    for name, v in (("block_h", block_h), ("block_k", block_k)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"mla_decode: {name}={v} must be a power of two >= 16")
    g = kv_pages.shape[1]
    m = -(-(t * n) // block_h) * block_h
    span_blocks = -(-(page_table.shape[1] * g) // block_k)
    sp = default_splits((m // block_h) * b, span_blocks) if splits is None else splits
    if sp < 1:
        raise ValueError(f"mla_decode: splits={sp} must be >= 1")
    # rows r = t * N + n of each sequence, padded to whole head blocks with position -1 (they see nothing)
    ql = jnp.pad(q_latent.reshape(b, t * n, lat), [(0, 0), (0, m - t * n), (0, 0)])
    qr = jnp.pad(q_rope.reshape(b, t * n, rope), [(0, 0), (0, m - t * n), (0, 0)])
    qpos = jnp.pad(jnp.repeat(q_positions.astype(jnp.int32), n, axis=1), [(0, 0), (0, m - t * n)], constant_values=-1)
    limits = jnp.minimum(kv_lengths.astype(jnp.int32), jnp.max(q_positions, axis=1).astype(jnp.int32) + 1)
    out, lse = mla_decode_pallas(
        ql, qr, qpos, limits, page_table,
        kv_pages.reshape(-1, kv_pages.shape[-1]),
        None if latent_scales is None else latent_scales.reshape(-1, latent_scales.shape[-1]),
        None if rope_pages is None else rope_pages.reshape(-1, rope),
        scale=float(scale), page_size=g, block_h=block_h, block_k=block_k, splits=sp, precision=precision,
        interpret=registry.interpret_default(interpret), num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if sp > 1:
        out, lse = merge_splits(out, lse)
        out = out.astype(q_latent.dtype)
    else:
        out, lse = out[:, 0], lse[:, 0]
    return out[:, : t * n].reshape(b, t, n, lat), lse[:, : t * n].reshape(b, t, n)
