"""Sharding: logical axis names (what model code says) mapped to mesh axes dp / cp / tp / ep (rules.py), the
mesh builder, the zigzag layout and state-parallel linear attention."""

from sharding.mesh import make_mesh
from sharding.rules import (
    LOGICAL_AXIS_RULES,
    constrain,
    logical_to_spec,
    param_partition_specs,
    param_sharding,
    shard_params,
)

__all__ = [
    "LOGICAL_AXIS_RULES",
    "constrain",
    "logical_to_spec",
    "make_mesh",
    "param_partition_specs",
    "param_sharding",
    "shard_params",
]
