"""Operators behind one public function each: a float32 jnp reference (the ground truth) and, where
written, Pallas kernels. Each op folder holds `reference.py` and `api.py`; callers use the api only."""

from pallas_kernels._pallas import OPS, use_pallas

__all__ = ["OPS", "use_pallas"]
