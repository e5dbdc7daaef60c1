from pallas_kernels.attention.api import attention

__all__ = ["attention"]
