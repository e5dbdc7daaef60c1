"""Public entry point of index-based sparse MLA."""

from __future__ import annotations

from pallas_kernels.sparse_attention.reference import sparse_mla_reference

IMPLS = ("auto", "reference")


def sparse_mla(q_latent, q_rope, kv_pages, page_table, indices, *, scale: float, impl: str = "auto"):
    """Absorbed-form MLA over selected positions.

    q_latent [B,T,N,L] (W_UK already absorbed), q_rope [B,T,N,R], kv_pages [P,G,L+R] latent pool,
    page_table [B,n], indices [B,T,K] int32 positions (-1 = unused).
    Returns (out [B,T,N,L] in q_latent.dtype, natural-log LSE [B,T,N] float32, -inf where nothing is selected).
    """
    if impl not in IMPLS:
        raise ValueError(f"sparse_mla: unknown impl={impl!r}; expected one of {IMPLS}")
    if kv_pages.shape[-1] != q_latent.shape[-1] + q_rope.shape[-1]:
        raise ValueError(
            f"sparse_mla: kv_pages width {kv_pages.shape[-1]} != latent {q_latent.shape[-1]} + rope {q_rope.shape[-1]}"
        )
    return sparse_mla_reference(q_latent, q_rope, kv_pages, page_table, indices, scale=scale)
