"""Helpers shared by the Pallas kernels: compiler parameters, the power-of-two shape rule and what
`impl="auto"` resolves to."""

from __future__ import annotations

import contextlib
import contextvars

import jax

_PREFER_PALLAS = contextvars.ContextVar("prefer_pallas", default=None)


@contextlib.contextmanager
def use_pallas(enabled: bool = True):
    """Inside this block every op's `impl="auto"` picks its Pallas kernel wherever the shapes allow, on any
    backend (interpret mode on CPU), including kernels that "auto" does not pick by default (the KDA
    prefill); with enabled=False it picks the jnp references everywhere (e.g. to compare on a GPU). Read at
    trace time and not part of jit's cache key: a function already traced outside the block keeps its
    trace, so make the `jax.jit` (or `jax.make_jaxpr`) of a fresh function inside the block.

        with pallas_kernels.use_pallas():
            logits, cache = model.prefill(ids, cache)   # the model's ops through their kernels
    """
    token = _PREFER_PALLAS.set(bool(enabled))
    try:
        yield
    finally:
        _PREFER_PALLAS.reset(token)


def auto_impl(supported: bool, *, default_on_gpu: bool = True) -> bool:
    """Whether `impl="auto"` runs the Pallas kernel: the shapes must be `supported`, and `use_pallas()` is
    active, or no `use_pallas(False)` is and the backend is a GPU where the kernel is the measured default."""
    if not supported:
        return False
    forced = _PREFER_PALLAS.get()
    if forced is not None:
        return forced
    return default_on_gpu and jax.default_backend() == "gpu"


def pow2(n: int) -> int:
    """The smallest power of two >= n (Triton's loaded tiles must have power-of-two sizes)."""
    return 1 << max(0, (n - 1).bit_length())


def triton_params(interpret: bool, num_warps: int, num_stages: int) -> dict:
    """`pallas_call` keyword arguments: Triton compiler parameters on GPU, nothing in interpret mode."""
    if interpret:
        return {}
    from jax.experimental.pallas import triton as pltriton

    return {"compiler_params": pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)}
