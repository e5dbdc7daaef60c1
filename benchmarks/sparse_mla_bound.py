"""What bounds sparse MLA decode: the default kernel's loop taken apart. Rows go to benchmarks/results/.

The decode goal (issue 6) is 50% of the bf16 tensor bound; the kernel (`sparse_attention.kernel`) runs one
program per (query, 32-head block) and each program gathers the query's selected rows again. This script
times, at the benchmark's decode shape (B=64 x 128 heads, top-2048 of 8192 rows per query, bf16 rows, the
default tile of 32 heads x 64 rows, 4 warps, 3 stages, head blocks inner in the grid):
  - "full": the library kernel (`sparse_mla_pallas`);
  - "gather only": the same loop's loads of the selected rows, then a sum of them instead of the products
    (what the gathers cost with nearly nothing to hide them behind);
  - "products only": the same loop's products and online softmax on one block of rows loaded before the
    loop (what the tensor-core work costs without gathers);
  - "transposed products": the loop written as S^T = K Q^T and O^T = V^T P^T, so that both products have a
    64-row (M) side and lower to `wgmma` with both operands in shared memory (the default tile's products
    are `mma.sync`, whose operands live in registers) — at 32 heads x 64 rows, 4 warps, 2 stages (3 stages
    need more shared memory than the H200 has) and at 64 heads x 64 rows, 8 warps, 2 stages;
each with the rows drawn from each query's own 8192 (the benchmark's pool: 604 MB, far beyond L2) and from
one shared set of 16384 rows (19 MB: every gather hits L2), and, for "full", in sorted order (what the
indexer's `sort=False` hands over).

Columns: gathered GB/s counts every program's row reads (4 head blocks each read the query's 2048 rows:
604 MB a call; 2 for 64-head blocks); TFLOP/s the call's products (2·B·heads·K·(2L + R)); % of bound the
call's time against the tensor bound at the measured bf16 matmul rate.

With --mosaic (sm_90): the Mosaic GPU kernel (`sparse_attention.mosaic_gpu`) taken apart the same way on a
BF16 pool and on an FP8 latent pool (E4M3, a float32 scale per 128 columns, bf16 rope apart) through its `probe`
argument: full, the producer alone (no products) and the consumers alone (no row loads), 40 separate
dispatches of one input each.

    python -m benchmarks.sparse_mla_bound [--no-record] [--mosaic]
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from benchmarks.common import ceilings, chained_ms, median_ms, report
from pallas_kernels._pallas import triton_params
from pallas_kernels.sparse_attention.kernel import sparse_mla_pallas

B, HEADS, LAT, ROPE, TOPK, ROWS_PER_QUERY, SHARED_ROWS = 64, 128, 512, 64, 2048, 8192, 16384
SCALE = 0.1
_NT = (((1,), (1,)), ((), ()))  # [M, D] x [N, D] -> [M, N]
_TN = (((0,), (0,)), ((), ()))  # [K, M] x [K, N] -> [M, N]


def _probe_kernel(ql_ref, qr_ref, slots_ref, kv_ref, o_ref, *, mode, block_k, n_blocks):
    """The default kernel's loop (`sparse_attention.kernel._kernel` without masking: every slot is valid
    here), cut down to its gathers ("gather"), its products ("products"), or transposed ("transposed")."""
    bf = jnp.bfloat16
    ql, qr = ql_ref[...].astype(bf), qr_ref[...].astype(bf)  # [BH, L], [BH, R]
    bh = qr.shape[0]

    def rows_of(j):
        rows = slots_ref[pl.ds(j * block_k, block_k)]
        return kv_ref[rows, pl.ds(0, LAT)].astype(bf), kv_ref[rows, pl.ds(LAT, ROPE)].astype(bf)  # [BK, L], [BK, R]

    first = rows_of(0)

    def body(j, carry):
        m, l_sum, acc = carry
        if mode == "gather":
            c, kr = rows_of(j)
            return m, l_sum, acc + jnp.sum(c.astype(jnp.float32), axis=0)[None, :] + jnp.sum(kr.astype(jnp.float32))
        c, kr = first if mode == "products" else rows_of(j)
        if mode == "transposed":  # m, l_sum [1, BH], acc [L, BH]
            s = jax.lax.dot_general(kr, qr, _NT, preferred_element_type=jnp.float32)
            s = (s + jax.lax.dot_general(c, ql, _NT, preferred_element_type=jnp.float32)) * SCALE  # [BK, BH]
            m_new = jnp.maximum(m, jnp.max(s, axis=0, keepdims=True))
            p, alpha = jnp.exp(s - m_new), jnp.exp(m - m_new)
            pv = jax.lax.dot_general(c, p.astype(bf), _TN, preferred_element_type=jnp.float32)  # [L, BH]
            return m_new, l_sum * alpha + jnp.sum(p, axis=0, keepdims=True), pv + acc * alpha
        s = jax.lax.dot_general(qr, kr, _NT, preferred_element_type=jnp.float32)
        s = (s + jax.lax.dot_general(ql, c, _NT, preferred_element_type=jnp.float32)) * SCALE  # [BH, BK]
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p, alpha = jnp.exp(s - m_new[:, None]), jnp.exp(m - m_new)
        acc = acc * alpha[:, None] + jnp.dot(p.astype(bf), c, preferred_element_type=jnp.float32)
        return m_new, l_sum * alpha + jnp.sum(p, axis=1), acc

    if mode == "transposed":
        init = (
            jnp.full((1, bh), -1e30, jnp.float32),
            jnp.zeros((1, bh), jnp.float32),
            jnp.zeros((LAT, bh), jnp.float32),
        )
        _, l_sum, acc = jax.lax.fori_loop(0, n_blocks, body, init)
        o_ref[...] = (acc / l_sum).T.astype(o_ref.dtype)
        return
    init = (jnp.full((bh,), -1e30, jnp.float32), jnp.zeros((bh,), jnp.float32), jnp.zeros((bh, LAT), jnp.float32))
    _, l_sum, acc = jax.lax.fori_loop(0, n_blocks, body, init)
    o_ref[...] = (acc / jnp.maximum(l_sum, 1e-30)[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("mode", "block_h", "block_k", "num_warps", "num_stages", "interpret"))
def probe(ql, qr, slots, kv, *, mode, block_h=32, block_k=64, num_warps=4, num_stages=3, interpret=False):
    """ql [Q, N, L], qr [Q, N, R], slots [Q, K] pool rows (all valid), kv [rows, L + R] -> [Q, N, L]."""
    nq, n, _ = ql.shape
    k = slots.shape[1]
    kernel = functools.partial(_probe_kernel, mode=mode, block_k=block_k, n_blocks=k // block_k)
    return pl.pallas_call(
        kernel,
        grid=(n // block_h, nq),  # head blocks inner, as the library kernel's default
        in_specs=[
            pl.BlockSpec((None, block_h, LAT), lambda h, i: (i, h, 0)),
            pl.BlockSpec((None, block_h, ROPE), lambda h, i: (i, h, 0)),
            pl.BlockSpec((None, k), lambda h, i: (i, 0)),
            pl.BlockSpec(kv.shape, lambda h, i: (0, 0)),
        ],
        out_specs=pl.BlockSpec((None, block_h, LAT), lambda h, i: (i, h, 0)),
        out_shape=jax.ShapeDtypeStruct((nq, n, LAT), ql.dtype),
        interpret=interpret,
        name=f"sparse_mla_probe_{mode}",
        **triton_params(interpret, num_warps, num_stages),
    )(ql, qr, slots, kv)


def inputs(key, b=B, heads=HEADS, topk=TOPK, rows_per_query=ROWS_PER_QUERY, shared_rows=SHARED_ROWS):
    """(ql, qr, kv pool, {"own rows": slots, "own rows, sorted": ..., "shared rows (L2)": ...})."""
    ks = jax.random.split(key, 5)
    kv = jax.random.normal(ks[0], (b * rows_per_query, LAT + ROPE), jnp.float32).astype(jnp.bfloat16)
    ql = jax.random.normal(ks[1], (b, heads, LAT), jnp.bfloat16)
    qr = jax.random.normal(ks[2], (b, heads, ROPE), jnp.bfloat16)
    pick = lambda k, n: jax.vmap(lambda kk: jax.random.permutation(kk, n)[:topk])(jax.random.split(k, b))  # noqa: E731
    own = (pick(ks[3], rows_per_query) + jnp.arange(b)[:, None] * rows_per_query).astype(jnp.int32)
    shared = pick(ks[4], shared_rows).astype(jnp.int32)
    return ql, qr, kv, {"own rows": own, "own rows, sorted": jnp.sort(own, axis=1), "shared rows (L2)": shared}


# (label, mode, block_h, block_k, warps, stages, row sets)
CASES = (
    ("full (library kernel)", "full", 32, 64, 4, 3, ("own rows", "own rows, sorted", "shared rows (L2)")),
    ("gather only", "gather", 32, 64, 4, 3, ("own rows", "shared rows (L2)")),
    ("products only", "products", 32, 64, 4, 3, ("own rows",)),
    ("transposed products", "transposed", 32, 64, 4, 2, ("own rows",)),
    ("transposed products", "transposed", 64, 64, 8, 2, ("own rows",)),
)


def rows(rate: float) -> list[dict]:
    ql, qr, kv, slot_sets = inputs(jax.random.key(0))
    flops = 2 * B * HEADS * TOPK * (2 * LAT + ROPE)
    out = []
    for label, mode, bh, bk, nw, ns, sets in CASES:
        for name in sets:
            slots = slot_sets[name]
            if mode == "full":
                fn = jax.jit(
                    functools.partial(
                        sparse_mla_pallas, scale=SCALE, block_h=bh, block_k=bk, precision="bf16", interpret=False,
                        num_warps=nw, num_stages=ns,
                    )
                )  # fmt: skip
            else:
                fn = functools.partial(probe, mode=mode, block_h=bh, block_k=bk, num_warps=nw, num_stages=ns)
            ms = chained_ms(fn, ql, qr, slots, kv)
            gathered = (HEADS // bh) * B * TOPK * (LAT + ROPE) * 2 if mode != "products" else 0
            out.append(
                {
                    "loop": label,
                    "tile (heads, rows, warps, stages)": f"{bh}, {bk}, {nw}, {ns}",
                    "rows": name,
                    "ms": f"{ms:.3f}",
                    "gathered GB/s": f"{gathered / ms / 1e6:,.0f}" if gathered else "",
                    "TFLOP/s": f"{flops / ms / 1e9:.0f}" if mode != "gather" else "",
                    "% of tensor bound": f"{flops / rate / (ms * 1e-3):.0%}" if mode != "gather" else "",
                }
            )
    return out


# (label, probe on a BF16 pool, probe on an FP8 pool)
MOSAIC_CASES = (
    ("full (library kernel)", "", ""),
    ("producer only (no products)", "nomma", "nomma"),
    ("consumers only (no row loads)", "nogather", "noconvert"),
)


def mosaic_rows(rate: float) -> list[dict]:
    from hybrid_jax.quant.formats import quantize_kv_fp8
    from pallas_kernels.sparse_attention.mosaic_gpu import sparse_mla_mosaic

    ql, qr, kv, slot_sets = inputs(jax.random.key(0))
    slots = slot_sets["own rows"]
    values, scales = quantize_kv_fp8(kv[:, :LAT].astype(jnp.float32), 128)
    pools = {"bf16": (kv,), "FP8 latent": (values, kv[:, LAT:], scales)}
    flops = 2 * B * HEADS * TOPK * (2 * LAT + ROPE)
    out = []
    for label, *probes in MOSAIC_CASES:
        for (pool, args), probe_arg in zip(pools.items(), probes, strict=True):
            fn = jax.jit(functools.partial(sparse_mla_mosaic, scale=SCALE, probe=probe_arg))
            ms = median_ms(functools.partial(fn, ql, qr, slots, *args), warmup=2, iters=10, calls=40)
            out.append(
                {
                    "loop": label,
                    "pool": pool,
                    "ms": f"{ms:.3f}",
                    "TFLOP/s": f"{flops / ms / 1e9:.0f}",
                    "% of tensor bound": f"{flops / rate / (ms * 1e-3):.0%}",
                }
            )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--no-record", action="store_true")
    p.add_argument("--mosaic", action="store_true", help="the Mosaic GPU kernel's rows instead (sm_90)")
    args = p.parse_args()
    if args.mosaic:
        from pallas_kernels.registry import device_text, is_sm90

        if not is_sm90():
            p.error(f"--mosaic times the Mosaic GPU kernel, which needs an sm_90 GPU (found {device_text()})")
    _, rate = ceilings()
    if args.mosaic:
        title = (
            f"Sparse MLA decode, Mosaic GPU kernel taken apart: B={B} x {HEADS} heads, L={LAT} R={ROPE}, top-{TOPK} "
            f"of {ROWS_PER_QUERY} rows per query, 40 separate dispatches; bf16 matmul at {rate / 1e12:.0f} TFLOP/s"
        )
        report("sparse_mla_bound.py", title, mosaic_rows(rate), record=not args.no_record)
        return
    title = (
        f"Sparse MLA decode taken apart: B={B} x {HEADS} heads, L={LAT} R={ROPE}, top-{TOPK} of {ROWS_PER_QUERY} "
        f"rows per query, bf16, 10 chained calls; bf16 matmul measured at {rate / 1e12:.0f} TFLOP/s"
    )
    report("sparse_mla_bound.py", title, rows(rate), record=not args.no_record)


if __name__ == "__main__":
    main()
