"""Public entry point of index-based sparse MLA."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._pallas import auto_impl, pow2
from pallas_kernels.paged import slot_index
from pallas_kernels.sparse_attention.kernel import sparse_mla_fp8_pallas, sparse_mla_pallas
from pallas_kernels.sparse_attention.reference import sparse_mla_reference

IMPLS = ("auto", "reference", "pallas")


def sparse_mla(
    q_latent,
    q_rope,
    kv_pages,
    page_table,
    indices,
    *,
    scale: float,
    impl: str = "auto",
    block_h: int = 16,
    block_k: int = 32,
    precision: str = "tf32",
    interpret: bool | None = None,
    latent_scales=None,
    rope_pages=None,
):
    """Absorbed-form MLA over selected positions.

    q_latent [B,T,N,L] (W_UK already absorbed), q_rope [B,T,N,R], kv_pages [P,G,L+R] latent pool,
    page_table [B,n], indices [B,T,K] int32 positions (-1 = unused).
    Returns (out [B,T,N,L] in q_latent.dtype, natural-log LSE [B,T,N] float32, -inf where nothing is selected).
    impl: "reference" (jnp), "pallas" (`kernel.sparse_mla_pallas`: rows gathered from the pool inside the
    kernel, online softmax; L and R powers of two; `block_h` heads and `block_k` rows per step, `precision`
    "tf32" or "ieee" for its products, `interpret` default on CPU), or "auto" (Pallas on GPU when L and R
    are powers of two with R >= 16 — 4-6x the reference on the H200, BENCHMARKS.md — else the reference).
    Split pools: pass `kv_pages` = the latent pool [P,G,L] and `rope_pages` [P,G,R] (the model's cache keeps
    them apart; the kernel reads both, so no step concatenates the pools). FP8 latent cache: in addition
    `latent_scales` [P,G,L/tile] float32 with `kv_pages` in E4M3; the Pallas kernel dequantizes the selected
    rows in the kernel, the reference dequantizes the pool first.
    """
    if impl not in IMPLS:
        raise ValueError(f"sparse_mla: unknown impl={impl!r}; expected one of {IMPLS}")
    if latent_scales is not None and rope_pages is None:
        raise ValueError("sparse_mla: an FP8 latent pool (latent_scales) needs its rope pool (rope_pages)")
    b, t, n, lat = q_latent.shape
    rope = q_rope.shape[-1]
    want = (lat,) if rope_pages is not None else (lat + rope,)
    if kv_pages.shape[-1:] != want or (rope_pages is not None and rope_pages.shape[-1] != rope):
        got = kv_pages.shape[-1] if rope_pages is None else (kv_pages.shape[-1], rope_pages.shape[-1])
        raise ValueError(f"sparse_mla: pool width {got} does not match latent {lat} + rope {rope}")
    supported = lat == pow2(lat) and rope == pow2(rope) and rope >= 16
    if impl == "auto":
        impl = "pallas" if auto_impl("sparse_mla", supported) else "reference"
    if impl != "pallas":
        if latent_scales is not None:
            p, g, _ = kv_pages.shape
            tile = lat // latent_scales.shape[-1]
            dense = kv_pages.astype(jnp.float32).reshape(p, g, -1, tile) * latent_scales[..., None].astype(jnp.float32)
            kv_pages = dense.reshape(p, g, lat)
        if rope_pages is not None:
            dt = jnp.promote_types(kv_pages.dtype, rope_pages.dtype)
            kv_pages = jnp.concatenate([kv_pages.astype(dt), rope_pages.astype(dt)], axis=-1)
        return sparse_mla_reference(q_latent, q_rope, kv_pages, page_table, indices, scale=scale)
    if not supported:
        raise ValueError(f"sparse_mla(impl='pallas'): latent {lat} and rope {rope} must be powers of two (rope >= 16)")
    k = indices.shape[-1]
    kp = -(-k // block_k) * block_k
    np_ = -(-n // block_h) * block_h
    # Pool rows of the selected positions; -1 stays -1 (and padding adds more of them).
    slots = jnp.where(indices >= 0, slot_index(page_table, jnp.maximum(indices, 0), kv_pages.shape[1]), -1)
    slots = jnp.pad(slots.reshape(b * t, k), [(0, 0), (0, kp - k)], constant_values=-1)
    heads = [(0, 0), (0, np_ - n), (0, 0)]
    kw = dict(
        scale=float(scale), block_h=block_h, block_k=block_k, precision=precision,
        interpret=jax.default_backend() == "cpu" if interpret is None else interpret,
    )  # fmt: skip
    ql = jnp.pad(q_latent.reshape(b * t, n, lat), heads)
    qr = jnp.pad(q_rope.reshape(b * t, n, rope), heads)
    if latent_scales is None:
        rope_rows = None if rope_pages is None else rope_pages.reshape(-1, rope)
        out, lse = sparse_mla_pallas(
            ql, qr, slots.astype(jnp.int32), kv_pages.reshape(-1, kv_pages.shape[-1]), rope_rows, **kw
        )  # fmt: skip
    else:
        out, lse = sparse_mla_fp8_pallas(
            ql, qr, slots.astype(jnp.int32), kv_pages.reshape(-1, lat),
            latent_scales.reshape(-1, latent_scales.shape[-1]).astype(jnp.float32), rope_pages.reshape(-1, rope), **kw,
        )  # fmt: skip
    return out[:, :n].reshape(b, t, n, lat), lse[:, :n].reshape(b, t, n)
