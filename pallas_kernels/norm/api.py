"""Public entry point of the RMSNorm (+ residual add) op."""

from __future__ import annotations

import math

from pallas_kernels import registry
from pallas_kernels.norm.kernel import rms_norm_pallas, slab
from pallas_kernels.norm.reference import rms_norm_reference
from pallas_kernels.norm.tuning import MAX_ROWS


def norm_uses_kernel(x) -> bool:
    """Whether `rms_norm(x, impl="auto")` runs the kernel (`registry.resolve("rms_norm", ...)`: opt-in, it
    measured slower than XLA's fused norm)."""
    return _choice(x, "auto").impl == "pallas"


def _choice(x, impl: str) -> registry.Choice:
    return registry.resolve("rms_norm", impl, rows=math.prod(x.shape[:-1]), slab_ok=slab(x.shape[-1]) is not None)


def rms_norm(x, weight, *, eps: float, residual=None, out_dtype=None, impl: str = "auto", interpret=None):
    """(h, y): h = x + residual (x's dtype; x itself without a residual), y = RMSNorm(h) ⊙ weight in
    out_dtype (default x's dtype), statistics in float32 (`reference.rms_norm_reference`).

    x [..., D]; weight [D]; residual like x. impl: "reference", "pallas" (`kernel.rms_norm_pallas`, one
    program per row, at most `tuning.MAX_ROWS` rows) or "auto" (`registry.resolve("rms_norm", ...)`)."""
    registry.check_impl("rms_norm", impl)
    if weight.shape != x.shape[-1:] or (residual is not None and residual.shape != x.shape):
        raise ValueError(
            f"rms_norm: weight {weight.shape} must be [{x.shape[-1]}] and residual "
            f"{None if residual is None else residual.shape} like x {x.shape}"
        )
    out_dtype = x.dtype if out_dtype is None else out_dtype
    impl = _choice(x, impl).impl
    if impl == "reference":
        return rms_norm_reference(x, weight, eps=eps, residual=residual, out_dtype=out_dtype)
    rows = math.prod(x.shape[:-1])
    if rows > MAX_ROWS or slab(x.shape[-1]) is None:
        raise ValueError(
            f"rms_norm: the kernel takes at most {MAX_ROWS} rows of a width with power-of-two slabs >= 16, "
            f"got x {x.shape}"
        )
    interpret = registry.interpret_default(interpret)
    flat = lambda a: None if a is None else a.reshape(rows, x.shape[-1])  # noqa: E731
    h, y = rms_norm_pallas(flat(x), weight, flat(residual), eps=float(eps), out_dtype=out_dtype, interpret=interpret)
    return h.reshape(x.shape), y.reshape(x.shape)
