"""Projections at decode row counts: does XLA's bf16 x @ W keep the bandwidth of a weight read when x has
1-16 rows? Each shape as XLA compiles it, with the rows padded to 16 (one tensor-core tile), and through
the `projection` op's Pallas GEMV (`pallas_kernels.projection`: its automatic tiles and split, and
variants of them), beside the floor (weight bytes over the measured HBM bandwidth). Device time from
chained calls in one executable (`common.loop_ms`). Rows go to benchmarks/results/.

    python -m benchmarks.small_m [--rows 1 4 16] [--no-pallas-variants] [--no-record]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.common import ceilings, loop_ms, report, roofline_row
from pallas_kernels.projection import api, project

SHAPES = {  # in, out: Kimi-Linear-48B widths
    "q/k/v projection 2304 -> 4096": (2304, 4096),
    "o_proj 4096 -> 2304": (4096, 2304),
    "shared expert gate 2304 -> 1024": (2304, 1024),
    "dense MLP gate 2304 -> 9216": (2304, 9216),
    "lm_head 2304 -> 163840": (2304, 163840),
}
# Pallas GEMV variants beside the automatic tiles: (label, project() keyword arguments)
PALLAS_VARIANTS = (
    ("block_n 64", dict(block_n=64)),
    ("block_k 32", dict(block_k=32)),
    ("4 stages", dict(num_stages=4)),
    ("8 warps", dict(num_warps=8)),
)


class _Proj(nnx.Module):
    def __init__(self, d, f, pad_to=0, pallas=None):
        self.w = nnx.Param(jax.random.normal(jax.random.key(0), (d, f), jnp.bfloat16) * d**-0.5)
        self.pad_to = pad_to
        self.pallas = pallas  # None: XLA; a dict: project(impl="pallas", **pallas)

    def __call__(self, x):  # x [M, D]
        if self.pallas is not None:
            return project(x, self.w[...], impl="pallas", out_dtype=jnp.float32, **self.pallas)
        m = x.shape[0]
        if self.pad_to and m < self.pad_to:
            x = jnp.pad(x, [(0, self.pad_to - m), (0, 0)])
        return jnp.dot(x, self.w[...], preferred_element_type=jnp.float32)[:m]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--no-pallas-variants", action="store_true", help="the Pallas GEMV with its automatic tiles only")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args()
    bw, rate = ceilings()
    rows = []
    for name, (d, f) in SHAPES.items():
        for m in args.rows:
            x = jax.random.normal(jax.random.key(m), (m, d), jnp.bfloat16)
            nbytes, flops = d * f * 2 + m * (d + f) * 2, 2 * m * d * f
            for pad in (0, 16):
                if pad and m >= pad:
                    continue
                ms = loop_ms(lambda mod, x: mod(x), _Proj(d, f, pad), x)
                impl = "XLA dot" if not pad else f"XLA dot, rows padded to {pad}"
                rows.append(roofline_row("projection", f"{name}, {m} rows", impl, ms, flops, nbytes, bw, rate))
            if m > api.MAX_ROWS:
                continue
            bn, bk = api.auto_tiles(d, f)
            kind = "one row" if m == 1 else "rows padded to 16"
            auto = f"pallas gemv, {kind} (block_n {bn}, block_k {bk}, split {api.auto_split_k(d, f, bn, bk)})"
            variants = (("", {}),) + (() if args.no_pallas_variants else PALLAS_VARIANTS)
            for label, kw in variants:
                ms = loop_ms(lambda mod, x: mod(x), _Proj(d, f, pallas=kw), x)
                impl = auto if not label else f"pallas gemv, {kind}, {label}"
                rows.append(roofline_row("projection", f"{name}, {m} rows", impl, ms, flops, nbytes, bw, rate))
    title = (
        f"bf16 projections at decode row counts; ceilings: HBM {bw / 1e12:.2f} TB/s, matmul {rate / 1e12:.0f} TFLOP/s"
    )
    report("small_m.py", title, rows, record=not args.no_record)


if __name__ == "__main__":
    main()
