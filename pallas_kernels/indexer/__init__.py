from pallas_kernels.indexer.api import indexer_prolog, indexer_topk, prolog_uses_kernel

__all__ = ["indexer_prolog", "indexer_topk", "prolog_uses_kernel"]
