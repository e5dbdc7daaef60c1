"""Public entry point of Kimi Delta Attention (and Gated DeltaNet)."""

from __future__ import annotations

from pallas_kernels.linear_attention.reference import (
    apply_summary,
    compose_summaries,
    kda_chunked,
    kda_recurrent,
)
from pallas_kernels.linear_attention.reference import kda_state_summary as _kda_state_summary

__all__ = ["apply_summary", "compose_summaries", "kda", "kda_state_summary"]

IMPLS = ("auto", "recurrent", "chunked")


def kda(
    q, k, v, g, beta, *, initial_state=None, scale=None, use_qk_l2norm=True, impl: str = "auto", chunk_size: int = 64
):
    """Gated delta rule with per-channel (g [B,T,N,K]) or per-head (g [B,T,N]) log decay.

    q, k [B,T,N,K]; v [B,T,N,V]; beta [B,T,N]; initial_state [B,N,K,V] float32 or None.
    Returns (o [B,T,N,V] in q.dtype, final_state [B,N,K,V] float32). q and k are L2-normalised inside
    (eps 1e-6 under the root) when use_qk_l2norm; q is scaled by `scale` (default K^-1/2).
    impl: "recurrent" (token scan), "chunked" (WY/UT chunks of `chunk_size`), or "auto"
    (recurrent for a single token, chunked otherwise).
    """
    if impl not in IMPLS:
        raise ValueError(f"kda: unknown impl={impl!r}; expected one of {IMPLS}")
    if q.ndim != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3] or beta.shape != q.shape[:3]:
        raise ValueError(f"kda: inconsistent shapes q={q.shape} k={k.shape} v={v.shape} beta={beta.shape}")
    if g.shape not in (q.shape, q.shape[:3]):
        raise ValueError(f"kda: g.shape={g.shape} must be {q.shape} (per channel) or {q.shape[:3]} (per head)")
    if chunk_size <= 0:
        raise ValueError(f"kda: chunk_size={chunk_size} must be positive")
    if impl == "auto":
        impl = "recurrent" if q.shape[1] == 1 else "chunked"
    kw = dict(initial_state=initial_state, scale=scale, use_qk_l2norm=use_qk_l2norm)
    if impl == "recurrent":
        return kda_recurrent(q, k, v, g, beta, **kw)
    return kda_chunked(q, k, v, g, beta, chunk_size=chunk_size, **kw)


def kda_state_summary(k, v, g, beta, *, use_qk_l2norm=True, chunk_size: int = 64, impl: str = "auto"):
    """Context-parallel state summary of one sequence shard: (M [B,N,K,K], E [B,N,K,V]) float32 with
    S_end = M S_start + E. impl: "reference" (chunk-wise jnp) or "auto"."""
    if impl not in ("auto", "reference"):
        raise ValueError(f"kda_state_summary: unknown impl={impl!r}; expected one of ('auto', 'reference')")
    return _kda_state_summary(k, v, g, beta, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)
