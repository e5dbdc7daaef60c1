from pallas_kernels.sparse_attention.api import sparse_mla

__all__ = ["sparse_mla"]
