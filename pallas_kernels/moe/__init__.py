from pallas_kernels.moe.api import moe_experts, moe_route
from pallas_kernels.moe.reference import route_reference

__all__ = ["moe_experts", "moe_route", "route_reference"]
