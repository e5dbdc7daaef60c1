"""Projections at decode row counts: does XLA's bf16 x @ W keep the bandwidth of a weight read when x has
1-16 rows? Each shape as XLA compiles it, and with the rows padded to 16 (one tensor-core tile), beside
the floor (weight bytes over the measured copy bandwidth). Device time from chained calls in one
executable (`common.loop_ms`). One table, BENCHMARKS.md.

    python -m benchmarks.small_m [--rows 1 2 4 8 16 64] [--no-record]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.common import ceilings, loop_ms, report, roofline_row

SHAPES = {  # in, out: Kimi-Linear-48B widths
    "q/k/v projection 2304 -> 4096": (2304, 4096),
    "o_proj 4096 -> 2304": (4096, 2304),
    "lm_head 2304 -> 163840": (2304, 163840),
}


class _Proj(nnx.Module):
    def __init__(self, d, f, pad_to):
        self.w = nnx.Param(jax.random.normal(jax.random.key(0), (d, f), jnp.bfloat16) * d**-0.5)
        self.pad_to = pad_to

    def __call__(self, x):  # x [M, D]
        m = x.shape[0]
        if self.pad_to and m < self.pad_to:
            x = jnp.pad(x, [(0, self.pad_to - m), (0, 0)])
        return jnp.dot(x, self.w[...], preferred_element_type=jnp.float32)[:m]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64])
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
    title = (
        f"bf16 projections at decode row counts; ceilings: copy {bw / 1e12:.2f} TB/s, matmul {rate / 1e12:.0f} TFLOP/s"
    )
    report("small_m.py", title, rows, record=not args.no_record)


if __name__ == "__main__":
    main()
