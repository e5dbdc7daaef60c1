from pallas_kernels.projection.api import auto_uses_kernel, project, project_group

__all__ = ["auto_uses_kernel", "project", "project_group"]
