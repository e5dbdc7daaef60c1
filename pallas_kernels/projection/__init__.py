from pallas_kernels.projection.api import SplitK, auto_uses_kernel, materialize, project, project_group

__all__ = ["SplitK", "auto_uses_kernel", "materialize", "project", "project_group"]
