from pallas_kernels.moe.api import moe_experts, moe_route

__all__ = ["moe_experts", "moe_route"]
