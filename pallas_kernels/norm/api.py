"""Public entry point of the RMSNorm (+ residual add) op."""

from __future__ import annotations

import math

import jax

from pallas_kernels._pallas import auto_impl
from pallas_kernels.norm.kernel import rms_norm_pallas, slab
from pallas_kernels.norm.reference import rms_norm_reference
from pallas_kernels.projection.api import kernel_allowed

IMPLS = ("auto", "reference", "pallas")
# The kernel stands for XLA's reduce + scale at decode sizes only (rows per call); prefill keeps XLA's.
MAX_ROWS = 16


def norm_uses_kernel(x) -> bool:
    """Whether `rms_norm(x, impl="auto")` runs the kernel: inside a `use_pallas()` block covering "rms_norm"
    for up to MAX_ROWS rows of a width that splits into power-of-two slabs, outside a multi-device mesh (XLA
    cannot partition a Pallas call; `projection.api.kernel_allowed`). Opt-in only: a decode step with it
    measured slower (Kimi-shaped B=1 1.155 vs 1.073 ms, `benchmarks.xla_flags --pallas-ops rms_norm`,
    48e30e6): XLA fuses the norm with the ops beside it, and the kernel splits those fusions."""
    supported = math.prod(x.shape[:-1]) <= MAX_ROWS and slab(x.shape[-1]) is not None and kernel_allowed()
    return auto_impl("rms_norm", supported, default_on_gpu=False)


def rms_norm(x, weight, *, eps: float, residual=None, out_dtype=None, impl: str = "auto", interpret=None):
    """(h, y): h = x + residual (x's dtype; x itself without a residual), y = RMSNorm(h) ⊙ weight in
    out_dtype (default x's dtype), statistics in float32 (`reference.rms_norm_reference`).

    x [..., D]; weight [D]; residual like x. impl: "reference", "pallas" (`kernel.rms_norm_pallas`, one
    program per row, at most MAX_ROWS rows) or "auto" (`norm_uses_kernel`)."""
    if impl not in IMPLS:
        raise ValueError(f"rms_norm: unknown impl={impl!r}; expected one of {IMPLS}")
    if weight.shape != x.shape[-1:] or (residual is not None and residual.shape != x.shape):
        raise ValueError(
            f"rms_norm: weight {weight.shape} must be [{x.shape[-1]}] and residual "
            f"{None if residual is None else residual.shape} like x {x.shape}"
        )
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if impl == "auto":
        impl = "pallas" if norm_uses_kernel(x) else "reference"
    if impl == "reference":
        return rms_norm_reference(x, weight, eps=eps, residual=residual, out_dtype=out_dtype)
    rows = math.prod(x.shape[:-1])
    if rows > MAX_ROWS or slab(x.shape[-1]) is None:
        raise ValueError(
            f"rms_norm: the kernel takes at most {MAX_ROWS} rows of a width with power-of-two slabs >= 16, "
            f"got x {x.shape}"
        )
    interpret = jax.default_backend() == "cpu" if interpret is None else interpret
    flat = lambda a: None if a is None else a.reshape(rows, x.shape[-1])  # noqa: E731
    h, y = rms_norm_pallas(flat(x), weight, flat(residual), eps=float(eps), out_dtype=out_dtype, interpret=interpret)
    return h.reshape(x.shape), y.reshape(x.shape)
