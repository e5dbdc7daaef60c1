from pallas_kernels.projection.api import auto_uses_kernel, project

__all__ = ["auto_uses_kernel", "project"]
