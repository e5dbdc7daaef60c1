"""Dense MLA decode over the paged pools (the "full" layers of Kimi-Linear at long context): the Pallas kernel
(`mla_decode`, pools read in place, context split at run time) against a bf16 XLA baseline and the float32
jnp reference, in the same run.

Every call is its own dispatch with the same inputs, N queued then one wait (`common.median_ms(calls=N)`):
nothing is chained inside one executable, so XLA cannot hoist the baseline's page gather out of a loop.

- pallas: `mla_decode(impl="pallas")`, default tiles and splits (or the --variants given);
- bf16 XLA: each sequence's pages gathered (bf16), scores and output by einsum with float32 accumulation and a
  float32 softmax, what XLA makes of the absorbed form without a kernel (the model's path before the kernel);
- reference: `mla_decode(impl="reference")`, float32 (`--no-reference` skips it).

Shapes: Kimi-Linear's MLA (32 heads, latent 512, rope 64, pages of 64), one query per sequence at the end of
its context, pages in a random order. `--span`: the page table spans this many positions (a cache made for a
longer prompt), the context is filled to the case's length only. Floor: the pools' bytes of the context read
once (BF16 576 values a row; FP8: 512 E4M3 + 4 float32 scales + 64 BF16) over the measured HBM bandwidth, or
the FLOPs 2·N·S·(2L + R) over the measured bf16 matmul rate if larger.

    python -m benchmarks.mla_decode [--cases 1:32768 1:131072 1:1048576 16:32768 16:131072 64:32768]
        [--span 0] [--fp8] [--variants BH:BK:WARPS:STAGES:SPLITS ...] [--calls 20] [--no-reference] [--no-record]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks.common import ceilings, median_ms, rel_err, report
from benchmarks.common import roofline_row as row
from hybrid_jax.quant.formats import quantize_kv_fp8
from pallas_kernels.mla_decode import mla_decode
from pallas_kernels.mla_decode.api import default_splits, default_tiles

HEADS, LAT, ROPE, PAGE = 32, 512, 64, 64
SCALE = 192**-0.5


def bf16_xla(ql, qr, lat_pages, rope_pages, table, lens):
    """The absorbed form without a kernel: gather, two einsums (float32 accumulation), float32 softmax."""
    c = lat_pages[table].reshape(table.shape[0], -1, LAT)  # [B,S,L]
    kr = rope_pages[table].reshape(table.shape[0], -1, ROPE)
    s = jnp.einsum("bnl,bsl->bns", ql[:, 0], c, preferred_element_type=jnp.float32)
    s = (s + jnp.einsum("bnr,bsr->bns", qr[:, 0], kr, preferred_element_type=jnp.float32)) * SCALE
    s = jnp.where(jnp.arange(c.shape[1])[None, None, :] < lens[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bns,bsl->bnl", p.astype(jnp.bfloat16), c, preferred_element_type=jnp.float32)[:, None]


def _variant(text: str) -> dict:
    bh, bk, warps, stages, splits = (int(x) for x in text.split(":"))
    return dict(block_h=bh, block_k=bk, num_warps=warps, num_stages=stages, splits=splits)


def case_rows(bw, rate, b, s, span, fp8, variants, calls, reference) -> list[dict]:
    span = max(span, s)
    per_seq = -(-span // PAGE)
    ks = jax.random.split(jax.random.key(b * 7 + s), 5)
    pages = b * per_seq
    lat = (0.5 * jax.random.normal(ks[0], (pages, PAGE, LAT), jnp.float32)).astype(jnp.bfloat16)
    rope = (0.5 * jax.random.normal(ks[1], (pages, PAGE, ROPE), jnp.float32)).astype(jnp.bfloat16)
    table = jax.random.permutation(ks[2], pages).reshape(b, per_seq).astype(jnp.int32)
    ql = jax.random.normal(ks[3], (b, 1, HEADS, LAT), jnp.bfloat16)
    qr = jax.random.normal(ks[4], (b, 1, HEADS, ROPE), jnp.bfloat16)
    lens = jnp.full((b,), s, jnp.int32)
    kw = dict(q_positions=lens[:, None] - 1, kv_lengths=lens, scale=SCALE, rope_pages=rope)
    scales = None
    if fp8:
        lat, scales = quantize_kv_fp8(lat.astype(jnp.float32), 128)
        kw["latent_scales"] = scales
    flops = 2 * b * HEADS * s * (2 * LAT + ROPE)
    row_bytes = (LAT + 4 * LAT // 128 + 2 * ROPE) if fp8 else 2 * (LAT + ROPE)
    nbytes = b * s * row_bytes
    shape = f"B={b}, S={s:,}" + (f" in a {span:,} span" if span > s else "") + (", FP8 latent" if fp8 else "")
    ref = jax.jit(lambda ql, qr, lat, table: mla_decode(ql, qr, lat, table, impl="reference", **kw)[0])
    want = ref(ql, qr, lat, table)
    rows = []

    def timed(name, fn, check=True):
        out = jax.block_until_ready(fn())
        err = f"rel err {rel_err(out.astype(jnp.float32), want):.1e}" if check else ""
        ms = median_ms(fn, warmup=2, iters=7, calls=calls)
        rows.append(row("dense MLA decode", shape, name, ms, flops, nbytes, bw, rate, err))

    bh, bk, warps, stages = default_tiles(HEADS, "bf16")
    sp = default_splits(b * (HEADS // bh), -(-(per_seq * PAGE) // bk))
    for v in [None, *variants]:
        knobs = {} if v is None else _variant(v)
        run = jax.jit(lambda ql, qr, lat, table, k=knobs: mla_decode(ql, qr, lat, table, impl="pallas", **k, **kw)[0])
        label = (
            f"pallas, default {bh}x{bk}x{warps}x{stages}, {sp} splits" if v is None
            else "pallas, {block_h}x{block_k}x{num_warps}x{num_stages}, {splits} splits".format(**knobs)
        )  # fmt: skip
        timed(label, lambda run=run: run(ql, qr, lat, table))
    if not fp8:
        base = jax.jit(bf16_xla)
        timed("bf16 XLA (gather + einsum)", lambda: base(ql, qr, lat, rope, table, lens))
    if reference:
        timed("jnp reference (float32)", lambda: ref(ql, qr, lat, table), check=False)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=["1:32768", "1:131072", "1:1048576", "16:32768", "16:131072"],
                   help="BATCH:CONTEXT")  # fmt: skip
    p.add_argument("--span", type=int, default=0, help="positions the page table spans (0: the context)")
    p.add_argument("--fp8", action="store_true", help="also the FP8 latent pool")
    p.add_argument("--variants", nargs="*", default=[], help="BH:BK:WARPS:STAGES:SPLITS")
    p.add_argument("--calls", type=int, default=20, help="dispatches queued per timing")
    p.add_argument("--no-reference", action="store_true")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args()
    bw, rate = ceilings()
    print(f"measured ceilings: HBM {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
    rows = []
    for case in args.cases:
        b, s = (int(x) for x in case.split(":"))
        for fp8 in (False, True) if args.fp8 else (False,):
            rows += case_rows(bw, rate, b, s, args.span, fp8, args.variants, args.calls, not args.no_reference)
    title = (
        f"Dense MLA decode (Kimi-Linear MLA: 32 heads, latent 512, rope 64), separate dispatches; ceilings "
        f"measured in this run: HBM {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s"
    )
    report("mla_decode.py", title, rows, record=not args.no_record)


if __name__ == "__main__":
    main()
