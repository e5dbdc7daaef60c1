"""Public entry point of the lightning indexer's causal Top-K."""

from __future__ import annotations

from pallas_kernels.indexer.reference import indexer_topk_reference

IMPLS = ("auto", "reference")


def indexer_topk(q, w, k_pages, page_table, *, q_positions, kv_lengths, topk: int, scale: float, impl: str = "auto"):
    """Top-K key positions per query from the paged indexer key cache.

    q [B,T,N,H] indexer queries; w [B,T,N] head weights; k_pages [P,G,H] key pool; page_table [B,n];
    q_positions [B,T]; kv_lengths [B]. Returns (indices [B,T,topk] int32, -1 = none; scores [B,T,topk]
    float32, -inf where none), best first, ties to the lower position.
    """
    if impl not in IMPLS:
        raise ValueError(f"indexer_topk: unknown impl={impl!r}; expected one of {IMPLS}")
    if topk <= 0:
        raise ValueError(f"indexer_topk: topk={topk} must be positive")
    return indexer_topk_reference(
        q, w, k_pages, page_table, q_positions=q_positions, kv_lengths=kv_lengths, topk=topk, scale=scale
    )
