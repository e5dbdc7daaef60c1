"""Operators behind one public function each: a float32 jnp reference (the ground truth) and, where
written, Pallas kernels. Each op folder holds `reference.py`, its kernels, `tuning.py` (tuned values as data)
and `api.py`; callers use the api only. What `impl="auto"` runs is decided in `registry.py`; `python -m
pallas_kernels --preset NAME` prints it for a model."""

from pallas_kernels.registry import IMPLS, OPS, pallas_call_allowed, use_pallas

__all__ = ["IMPLS", "OPS", "pallas_call_allowed", "use_pallas"]
