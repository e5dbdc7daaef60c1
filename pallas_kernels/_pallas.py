"""Helpers shared by the Pallas kernels: compiler parameters and the power-of-two shape rule."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def pow2(n: int) -> int:
    """The smallest power of two >= n (Triton's loaded tiles must have power-of-two sizes)."""
    return 1 << max(0, (n - 1).bit_length())


def first_row(acc):
    """Row 0 of a [16, N] tensor-core accumulator as [N]: a masked sum over rows (a row index of a value
    does not lower to Triton; this lowers everywhere and runs once per program)."""
    row = jax.lax.broadcasted_iota(jnp.int32, acc.shape, 0)
    return jnp.sum(jnp.where(row == 0, acc, 0.0), axis=0)


def sum_rows(ref, cols=slice(None)):
    """Σ_r ref[r, cols] in float32, one row at a time: a ref of S partial sums (a split-K producer's S need be
    no power of two, and the Triton lowering takes only power-of-two arrays)."""
    total = ref[0, cols].astype(jnp.float32)
    for r in range(1, ref.shape[0]):
        total = total + ref[r, cols].astype(jnp.float32)
    return total


def triton_params(interpret: bool, num_warps: int, num_stages: int) -> dict:
    """`pallas_call` keyword arguments: Triton compiler parameters on GPU, nothing in interpret mode."""
    if interpret:
        return {}
    from jax.experimental.pallas import triton as pltriton

    return {"compiler_params": pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)}
