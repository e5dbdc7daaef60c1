from pallas_kernels.linear_attention.api import kda

__all__ = ["kda"]
