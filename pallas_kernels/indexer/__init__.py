from pallas_kernels.indexer.api import indexer_prolog, indexer_topk, prolog_uses_kernel
from pallas_kernels.indexer.kpool import expand_pools, kpool_compress, pool_query_positions

__all__ = [
    "expand_pools", "indexer_prolog", "indexer_topk", "kpool_compress", "pool_query_positions", "prolog_uses_kernel",
]  # fmt: skip
