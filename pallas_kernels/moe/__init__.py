from pallas_kernels.moe.api import moe_experts

__all__ = ["moe_experts"]
