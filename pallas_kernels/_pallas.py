"""Helpers shared by the Pallas kernels: compiler parameters and the power-of-two shape rule."""

from __future__ import annotations


def pow2(n: int) -> int:
    """The smallest power of two >= n (Triton's loaded tiles must have power-of-two sizes)."""
    return 1 << max(0, (n - 1).bit_length())


def triton_params(interpret: bool, num_warps: int, num_stages: int) -> dict:
    """`pallas_call` keyword arguments: Triton compiler parameters on GPU, nothing in interpret mode."""
    if interpret:
        return {}
    from jax.experimental.pallas import triton as pltriton

    return {"compiler_params": pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)}
