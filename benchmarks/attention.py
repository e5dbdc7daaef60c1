"""Dense causal prefill attention at MLA shapes (the Kimi-Linear dense layers after `kv_b_proj`: 32 heads,
q/k head dim 192, v head dim 128, batch 1): the `attention` op's Pallas flash kernel with its default tiles
and variants of them, beside cuDNN's flash attention through `jax.nn.dot_product_attention` (v zero-padded
to the q/k width, which that API requires; an outside ceiling, not used by the model) and the float32 jnp
reference (short prompts only). FLOPs count the causal half: 2 * heads * (192 + 128) * T(T+1)/2; bytes are
q, k, v read and the output written once. Rows go to benchmarks/results/ (`common.report`).

    python -m benchmarks.attention [--lens 4096 32768] [--variants 128x64x8x3 ...] [--no-record]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks.common import ceilings, chained_ms, rel_err, report, roofline_row
from pallas_kernels.attention import api, attention

# block_q x block_k x num_warps x num_stages, beside the defaults
VARIANTS = ("64x64x4x2", "128x64x8x2", "128x128x8x2", "128x64x8x4")


def _parse(variant: str) -> dict:
    bq, bk, w, s = (int(x) for x in variant.split("x"))
    return dict(block_q=bq, block_k=bk, num_warps=w, num_stages=s)


def rows_for(t: int, n: int, h: int, hv: int, args, bw: float, rate: float) -> list[dict]:
    """The rows of one prompt length T: the reference (short T), the kernel's tiles, cuDNN."""
    ks = jax.random.split(jax.random.key(t), 3)
    q = jax.random.normal(ks[0], (1, t, n, h), jnp.bfloat16)
    k = jax.random.normal(ks[1], (1, t, n, h), jnp.bfloat16)
    v = jax.random.normal(ks[2], (1, t, n, hv), jnp.bfloat16)
    kw = dict(q_positions=jnp.arange(t, dtype=jnp.int32)[None], kv_lengths=jnp.full((1,), t, jnp.int32), scale=h**-0.5)
    flops = 2 * n * (h + hv) * t * (t + 1) / 2
    nbytes = (q.size + k.size + v.size + t * n * hv) * 2
    shape = f"T={t}, {n} heads, qk {h} / v {hv}, bf16"
    ref = jax.jit(lambda q, k, v: attention(q, k, v, impl="reference", **kw)[0])
    want = ref(q, k, v)
    rows = []

    def row(impl, fn):
        try:
            ms = chained_ms(fn, q, k, v, n=3)
        except Exception as e:  # tiles that do not fit (shared memory) still leave a row saying so
            print(f"  {impl}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            failed = {"median ms": "failed", "TFLOP/s": "", "GB/s": "", "% of floor": ""}
            rows.append({"case": "prefill attention", "shape": shape, "impl": impl, **failed,
                         "check vs reference": type(e).__name__})  # fmt: skip
            return
        check = f"rel err {rel_err(fn(q, k, v), want):.1e}"
        rows.append(roofline_row("prefill attention", shape, impl, ms, flops, nbytes, bw, rate, check))

    if t <= args.reference_max_len:
        row("jnp reference (float32)", ref)
    for label in ["default"] + args.variants:
        tiles = {} if label == "default" else _parse(label)
        if label == "default":
            label = "default " + "x".join(str(x) for x in api.default_tiles(q.dtype, h, hv, rows=t).values())
        row(f"pallas flash, {label}", jax.jit(lambda q, k, v, t=tiles: attention(q, k, v, impl="pallas", **t, **kw)[0]))

    def cudnn(q, k, v):
        vp = jnp.pad(v, [(0, 0), (0, 0), (0, 0), (0, h - hv)])
        out = jax.nn.dot_product_attention(q, k, vp, scale=h**-0.5, is_causal=True, implementation="cudnn")
        return out[..., :hv]

    row("cuDNN flash (jax.nn.dot_product_attention, v padded)", jax.jit(cudnn))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lens", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--dims", type=int, nargs=2, default=[192, 128], metavar=("QK", "V"))
    p.add_argument("--variants", nargs="*", default=list(VARIANTS), help="BQxBKxWARPSxSTAGES")
    p.add_argument("--reference-max-len", type=int, default=8192, help="time the jnp reference up to this T")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args()
    bw, rate = ceilings()
    h, hv = args.dims
    rows = [r for t in args.lens for r in rows_for(t, args.heads, h, hv, args, bw, rate)]
    report("attention.py", "Dense causal prefill attention (MLA shapes)", rows, record=not args.no_record)


if __name__ == "__main__":
    main()
