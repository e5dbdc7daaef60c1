"""Pallas kernel: the lightning indexer's decode prolog in one launch (`prolog_reference` gives the math).

A decode step's indexer inputs are a few rows (M = batch · new tokens); left to XLA, each of its small steps
— three projections, the key LayerNorm, two RoPEs, the head-weight scale — is a kernel of its own, each a
launch and a round trip of its intermediate through HBM. Here one grid covers all of it, the independent
parts running side by side on different SMs:

    program j < N   q head j:  c_q W_qb[:, j·H:(j+1)·H] -> bf16 -> RoPE -> q[:, j]
    program N       k:         x W_k -> bf16 -> LayerNorm -> bf16 -> RoPE -> k
    program N + 1   w:         x W_w (float32, IEEE products) · N^-1/2 -> w

Each projection streams its weight columns in place in BK-row slabs (tensor-core products, float32
accumulation). RoPE rotates channel c with c + R/2: the head's columns are produced as three groups — the
two rotary halves and the pass-through rest — so the rotation is elementwise on whole tiles (no slicing or
concatenation of values in the kernel), and the LayerNorm statistics are sums over the groups.

Opt-in (off in `registry`; `use_pallas(ops=["indexer_prolog"])`): slower than XLA's step-by-step prolog, as a
few latency-bound programs stream whole weight matrices; measurements in docs/performance.md#indexer.

Generic Pallas: Triton lowering on GPU, interpret mode on CPU (tests). Rows are padded to a power of two
>= 16; every column group must be a power of two (>= 16 on the GPU's tensor cores).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._pallas import pow2, triton_params

HIGHEST = jax.lax.Precision.HIGHEST


def column_groups(h: int, rope_dim: int) -> list[tuple[int, int]]:
    """(first column, width) of the rotary halves and the pass-through rest of one head of width h."""
    half = rope_dim // 2
    groups = [(0, half), (half, half)] if rope_dim else []
    return groups + ([(rope_dim, h - rope_dim)] if h > rope_dim else [])


def _slab(dim: int, cap: int) -> int:
    """The largest power of two <= cap dividing dim."""
    t = cap
    while dim % t:
        t //= 2
    return t


def _kernel(cq_ref, x_ref, wq_ref, wk_ref, lnw_ref, lnb_ref, wp_ref, cos_ref, sin_ref, q_ref, k_ref, w_ref,
            *, n, h, rope_dim, bk_q, bk_d, eps):  # fmt: skip
    j = pl.program_id(0)
    m = x_ref.shape[0]
    dt = q_ref.dtype
    half = rope_dim // 2
    groups = column_groups(h, rope_dim)

    def product(a_ref, b_ref, col, width, bk, exact=False):
        def body(i, acc):
            a = a_ref[:, pl.ds(i * bk, bk)]
            b = b_ref[pl.ds(i * bk, bk), pl.ds(col, width)]
            if exact:  # the head weights: float32 operands, IEEE products (as the reference)
                return acc + jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32), precision=HIGHEST)
            return acc + jnp.dot(a, b.astype(a.dtype), preferred_element_type=jnp.float32)

        return jax.lax.fori_loop(0, a_ref.shape[1] // bk, body, jnp.zeros((m, width), jnp.float32))

    def rounded(v):  # what a bf16 GEMM / a bf16 intermediate hands on
        return v.astype(dt).astype(jnp.float32)

    def store_rotated(ref, ys):
        if rope_dim:
            c, s = cos_ref[...], sin_ref[...]
            ref[:, pl.ds(0, half)] = (ys[0] * c - ys[1] * s).astype(dt)
            ref[:, pl.ds(half, half)] = (ys[0] * s + ys[1] * c).astype(dt)
        if h > rope_dim:
            ref[:, pl.ds(rope_dim, h - rope_dim)] = ys[-1].astype(dt)

    @pl.when(j < n)
    def _q_head():
        store_rotated(q_ref, [rounded(product(cq_ref, wq_ref, j * h + c0, wd, bk_q)) for c0, wd in groups])

    @pl.when(j == n)
    def _key():
        ys = [rounded(product(x_ref, wk_ref, c0, wd, bk_d)) for c0, wd in groups]
        mu = sum(jnp.sum(y, axis=1, keepdims=True) for y in ys) / h
        var = sum(jnp.sum(jnp.square(y - mu), axis=1, keepdims=True) for y in ys) / h
        inv = jax.lax.rsqrt(var + eps)
        normed = [
            rounded((y - mu) * inv * lnw_ref[pl.ds(c0, wd)][None, :] + lnb_ref[pl.ds(c0, wd)][None, :])
            for y, (c0, wd) in zip(ys, groups, strict=True)
        ]
        store_rotated(k_ref, normed)

    @pl.when(j == n + 1)
    def _head_weights():
        w_ref[...] = product(x_ref, wp_ref, 0, w_ref.shape[1], bk_d, exact=True) * n**-0.5


@functools.partial(jax.jit, static_argnames=("num_heads", "rope_dim", "eps", "block_k", "interpret", "num_warps"))
def indexer_prolog_pallas(x, c_q, wq_b, wk, ln_w, ln_b, wp, cos, sin, *, num_heads: int, rope_dim: int,
                          eps: float, block_k: int = 64, interpret: bool = False, num_warps: int = 4):  # fmt: skip
    """Shapes and outputs as `prolog_reference.indexer_prolog_reference`; Q and D multiples of 16."""
    m, d = x.shape
    q_in = c_q.shape[1]
    h = wk.shape[1]
    mp = max(16, pow2(m))
    rows = lambda a: jnp.pad(a, [(0, mp - m), (0, 0)])  # noqa: E731  (zero rows: finite, dropped after)
    half = max(1, rope_dim // 2)  # a width-1 placeholder table when there is no RoPE (never read)
    if rope_dim == 0:
        cos = sin = jnp.zeros((m, 1), jnp.float32)
    full = lambda *shape: pl.BlockSpec(shape, lambda j: (0,) * len(shape))  # noqa: E731
    q, k, w = pl.pallas_call(
        functools.partial(_kernel, n=num_heads, h=h, rope_dim=rope_dim, bk_q=_slab(q_in, block_k),
                          bk_d=_slab(d, block_k), eps=float(eps)),  # fmt: skip
        grid=(num_heads + 2,),
        in_specs=[
            full(mp, q_in), full(mp, d), full(q_in, num_heads * h), full(d, h), full(h), full(h),
            full(d, num_heads), full(mp, half), full(mp, half),
        ],  # fmt: skip
        out_specs=[
            pl.BlockSpec((mp, h), lambda j: (0, jnp.minimum(j, num_heads - 1))),  # head j's columns
            full(mp, h),
            full(mp, num_heads),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((mp, num_heads * h), x.dtype),
            jax.ShapeDtypeStruct((mp, h), x.dtype),
            jax.ShapeDtypeStruct((mp, num_heads), jnp.float32),
        ],
        interpret=interpret,
        name="indexer_prolog",
        **triton_params(interpret, num_warps, 2),
    )(rows(c_q), rows(x), wq_b, wk, ln_w.astype(jnp.float32), ln_b.astype(jnp.float32), wp.astype(jnp.float32),
      rows(cos.astype(jnp.float32)), rows(sin.astype(jnp.float32)))  # fmt: skip
    return q[:m].reshape(m, num_heads, h), k[:m], w[:m]
