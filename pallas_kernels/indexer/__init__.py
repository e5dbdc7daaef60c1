from pallas_kernels.indexer.api import indexer_topk

__all__ = ["indexer_topk"]
