from pallas_kernels.projection.api import (
    SplitK,
    auto_uses_kernel,
    launch_group,
    materialize,
    project,
    project_group,
)

__all__ = ["SplitK", "auto_uses_kernel", "launch_group", "materialize", "project", "project_group"]
