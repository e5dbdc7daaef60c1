from pallas_kernels.indexer.api import indexer_prolog, indexer_topk

__all__ = ["indexer_prolog", "indexer_topk"]
