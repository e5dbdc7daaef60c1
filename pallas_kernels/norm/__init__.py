from pallas_kernels.norm.api import norm_uses_kernel, rms_norm

__all__ = ["norm_uses_kernel", "rms_norm"]
