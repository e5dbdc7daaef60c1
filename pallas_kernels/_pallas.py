"""Helpers shared by the Pallas kernels: compiler parameters, the power-of-two shape rule and what
`impl="auto"` resolves to."""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

# The ops whose "auto" the switch below can steer (names for `use_pallas(ops=...)`).
OPS = (
    "kda_prefill",
    "kda_decode",
    "kda_decode_layer",
    "kda_summary",
    "indexer",
    "indexer_prolog",
    "sparse_mla",
    "moe",
    "moe_router",
    "attention",
    "projection",
    "rms_norm",
)
_PREFER_PALLAS = contextvars.ContextVar("prefer_pallas", default=None)  # (enabled, frozenset of ops)


@contextlib.contextmanager
def use_pallas(enabled: bool = True, *, ops=None):
    """Inside this block `impl="auto"` picks each op's Pallas kernel wherever the shapes allow, on any
    backend (interpret mode on CPU), including kernels that "auto" does not pick by default (the KDA
    prefill and CP summary, the MoE experts); with enabled=False it picks the jnp references (e.g. to
    compare on a GPU). `ops` limits the switch to some of `OPS` (the others keep their defaults). Read at
    trace time and not part of jit's cache key: a function already traced outside the block keeps its
    trace, so make the `jax.jit` (or `jax.make_jaxpr`) of a fresh function inside the block.

        with pallas_kernels.use_pallas():
            logits, cache = model.prefill(ids, cache)   # the model's ops through their kernels
        with pallas_kernels.use_pallas(ops=["moe"]):
            ...                                         # only the MoE experts switched
    """
    chosen = frozenset(OPS if ops is None else ops)
    unknown = sorted(chosen - set(OPS))
    if unknown:
        raise ValueError(f"use_pallas: unknown op(s) {unknown}; expected some of {OPS}")
    token = _PREFER_PALLAS.set((bool(enabled), chosen))
    try:
        yield
    finally:
        _PREFER_PALLAS.reset(token)


def auto_impl(op: str, supported: bool, *, default_on_gpu: bool = True) -> bool:
    """Whether `impl="auto"` of `op` runs the Pallas kernel: the shapes must be `supported`, and a
    `use_pallas()` block covering `op` says so, or none does and the backend is a GPU where the kernel is
    the measured default (`default_on_gpu`)."""
    if op not in OPS:
        raise ValueError(f"auto_impl: unknown op {op!r}")
    if not supported:
        return False
    forced = forced_choice(op)
    if forced is not None:
        return forced
    return default_on_gpu and jax.default_backend() == "gpu"


def forced_choice(op: str) -> bool | None:
    """What a `use_pallas()` block covering `op` asks for (True: kernel, False: reference), None outside one."""
    forced = _PREFER_PALLAS.get()
    return forced[0] if forced is not None and op in forced[1] else None


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
