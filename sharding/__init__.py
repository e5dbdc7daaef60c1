"""Sharding: logical axis names (what model code says) mapped to mesh axes dp / cp / tp / ep (rules.py)."""

from sharding.rules import LOGICAL_AXIS_RULES, logical_to_spec, param_partition_specs

__all__ = ["LOGICAL_AXIS_RULES", "logical_to_spec", "param_partition_specs"]
