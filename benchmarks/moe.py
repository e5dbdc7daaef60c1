"""MoE routed experts on one GPU: `lax.ragged_dot` (what XLA makes of it: a dense product over all experts)
against the Pallas grouped matmul, for decode-sized and prefill-sized token counts (and, at decode sizes,
the gathered-weights jnp form and the per-pair GEMV kernels). One table; rows go to
benchmarks/results/.

Floors: the weights of the experts the tokens touch (expected count under uniform routing) read once plus
x and y, over the measured HBM bandwidth; 2·3·D·F FLOPs per token-expert pair over the measured bf16
matmul rate; the larger.

    python -m benchmarks.moe [--shape kimi|hybrid_small] [--tokens 1 16 64 4096 32768] [--no-record]
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from benchmarks.common import CHAIN, ceilings, chained_ms, median_ms, rel_err, report, roofline_row
from pallas_kernels.moe import api, moe_experts

SHAPES = {  # D, F, E, k
    "kimi": (2304, 1024, 256, 8),
    "kimi32": (2304, 1024, 32, 8),
    "hybrid_small": (1536, 512, 32, 4),
    "tiny": (64, 32, 8, 2),
}
# (block_m, block_n, block_k, num_warps, num_stages) of the grouped kernels
VARIANTS = ((64, 128, 64, 4, 2), (128, 128, 64, 4, 2), (128, 128, 64, 8, 3), (128, 64, 64, 4, 3),
            (64, 128, 64, 4, 3), (16, 128, 64, 4, 2))  # fmt: skip
# (block_n, block_k, split_k) of the per-pair GEMV kernels (None: `gemv.auto_split_k`); block_k and the
# split divide D = 2304 (no padded weight copies); split 1 = the version without split-K (5f27973)
GEMV_BLOCKS = ((64, 64, 1), (64, 64, None), (32, 64, None), (64, 128, None))


# Decode-sized calls are timed as CHAIN calls in one executable (`common.chained_ms`), per call: what a layer
# costs inside a compiled decode step. One call per dispatch adds the ~0.1-0.15 ms host dispatch to every
# row (H200: the split-K gemv at one Kimi token, 0.21 ms per dispatch vs 0.077 ms chained, its two kernels
# 45 us in a profiler trace) and ranks the implementations by their launch counts.


def _timer(fn, args, decode: bool):
    """fn(*args) -> [N, D] float32; -> (output, median ms per call)."""
    if not decode:
        return fn(*args), median_ms(functools.partial(fn, *args), warmup=1, iters=3)
    return fn(*args), chained_ms(fn, *args)


def rows_for(shape: str, tokens: int, bw: float, rate: float) -> list[dict]:
    d, f, e, k = SHAPES[shape]
    ks = jax.random.split(jax.random.key(tokens), 6)
    x = jax.random.normal(ks[0], (tokens, d), jnp.bfloat16)
    idx = jax.lax.top_k(jax.random.normal(ks[1], (tokens, e)), k)[1].astype(jnp.int32)
    w = jax.nn.softmax(jax.random.normal(ks[2], (tokens, k)), axis=-1)
    gate, up = (jax.random.normal(kk, (e, d, f), jnp.bfloat16) * d**-0.5 for kk in ks[3:5])
    down = jax.random.normal(ks[5], (e, f, d), jnp.bfloat16) * f**-0.5
    touched = e * (1 - (1 - k / e) ** tokens)
    nbytes = touched * 3 * d * f * 2 + 2 * tokens * d * 2
    flops = 2 * 3 * d * f * tokens * k
    decode = tokens * k <= 512
    label = f"{shape}: {tokens} tokens, D={d} F={f} E={e} k={k}" + (f", {CHAIN} chained calls" if decode else "")
    args = (x, idx, w, gate, up, down)
    variants = {"lax.ragged_dot (XLA)": dict(impl="reference")}
    if tokens * k <= 256:  # decode sizes: each pair's expert weights gathered / read in place (opt-in impls)
        variants["gathered weights (XLA)"] = dict(impl="reference", form="gather")
        # the defaults: gate/up at GEMV_TILES, down at GEMV_DOWN_TILES (a tile given below tiles both kernels)
        variants["pallas per-pair gemv, default tiles, split auto"] = dict(impl="pallas", form="gemv")
        for bn, bk, sk in GEMV_BLOCKS:  # one Pallas program per pair, output tile and split
            name = f"pallas per-pair gemv, block_n={bn} k={bk} split {sk or 'auto'}"
            variants[name] = dict(impl="pallas", form="gemv", block_n=bn, block_k=bk, split_k=sk)
    if 1 < tokens <= 16:  # each touched expert read once for all its rows
        variants["pallas expert gemv, split auto"] = dict(impl="pallas", form="expert_gemv")
    for bm, bn, bk, nw, ns in VARIANTS:
        variants[f"pallas grouped matmul, block_m={bm} n={bn} k={bk}, {nw} warps, {ns} stages"] = dict(
            impl="pallas", block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns
        )
    if tokens * k <= 256:  # the per-pair kernels' CUDA-core form (before the tensor-core steps, 0ea4acd)
        variants["pallas per-pair gemv, CUDA-core multiply-adds, block_n=64 k=64 split auto"] = functools.partial(
            api._experts_gemv, block_n=64, block_k=64, split_k=None, interpret=jax.default_backend() == "cpu", mma=False
        )
    out, ref = [], None
    for name, kw in variants.items():
        fn = kw if callable(kw) else functools.partial(moe_experts, **kw)
        y, ms = _timer(jax.jit(fn), args, decode)
        check = "" if ref is None else f"rel err {rel_err(y, ref):.1e}"
        ref = y if ref is None else ref
        out.append(roofline_row("moe experts", label, name, ms, flops, nbytes, bw, rate, check))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", nargs="+", default=["kimi32", "hybrid_small"], choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 4096, 32768])
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args()
    bw, rate = ceilings()
    rows = [r for s in args.shape for t in args.tokens for r in rows_for(s, t, bw, rate)]
    title = f"MoE routed experts; ceilings: HBM {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s"
    report("moe.py", title, rows, record=not args.no_record)


if __name__ == "__main__":
    main()
