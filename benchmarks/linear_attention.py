"""KDA kernels on one GPU: decode step and chunked prefill, against the jnp reference, flash-linear-attention
and the roofline. One run prints one table (its rows go to benchmarks/results/).

Decode steps are timed 20 at a time: inside one jitted `fori_loop` for JAX, as one replayed CUDA graph for
fla, so neither pays a host dispatch per step; prefill calls 5 at a time back to back (JAX: wall time of
queued dispatches and one wait; fla: CUDA events around the 5), median of 10.
Floors: FLOPs over the measured bf16 matmul rate and bytes over the measured HBM bandwidth (both measured
at the start of the run); the larger is the floor and "% of floor" is floor / time. Decode bytes: the
float32 state read and written once (2·B·N·K·V·4) plus q, k, v, g, beta, o. Prefill bytes: q, k, v
(bf16), g (float32), beta, o (bf16) once; prefill FLOPs: the chunked WY/UT form at chunk 64 (see
`prefill_flops`).

fla (`fla-core`, Triton, PyTorch) runs in the same process when importable: carry its wheel and einops to
the GPU machine (`pip download --no-deps fla-core einops`).

    python -m benchmarks.linear_attention [--only decode|layer|prefill] [--mosaic] [--no-record]

`--mosaic`: also the prefill with its state pass in Mosaic GPU (`kda(impl="mosaic")`, Hopper only; for the
varlen batch one program per sequence); with
`--phases` the state pass's share is the whole prefill less phase 1 alone, for both state passes. Rows without
a form in their label run `kda`'s defaults at the recorded commit (the A kernel's block forms: `tuning.A_BLOCKS`);
`--a-blocks 64,16` or `--a-blocks split` adds a Mosaic row with those forms, or with the binary split alone.

`--only layer`: a KDA layer's decode token between its projections and o_proj (`kda_decode_layer`'s fused
kernel against the model's unfused step), B in {1, 16, 64}.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import ceilings, median_ms, rel_err, report, roofline_row
from pallas_kernels.linear_attention import kda, kda_decode_step
from pallas_kernels.linear_attention import tuning as kda_tuning
from pallas_kernels.linear_attention.chunked import A_BLOCK_SIZES, check_a_blocks

N, DK, DV, CHUNK = 32, 128, 128, 64


def torch_median_ms(fn, warmup: int = 3, iters: int = 20, calls: int = 1) -> float:
    """Median CUDA-event ms of fn() (per call, `calls` calls between the two events)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        ts.append(start.elapsed_time(end) / calls)
    return statistics.median(ts)


# Prefill timings: PREFILL_CALLS calls back to back per timing (both sides), median of PREFILL_ITERS — one call
# per timing with iters=5 had JAX pay its host dispatch + wait inside each timing, and two runs of the same
# kernel (f860793, 48e30e6) differed by 9% at 32K.
PREFILL_CALLS, PREFILL_ITERS = 5, 10


def prefill_flops(tokens: int, heads: int = N) -> float:
    """Chunked form per head and chunk of C, in MACs: K Kᵀ and Q Kᵀ (C²K each), the UT solve (~C³/3), W = A K
    and U = A V (C²K + C²V), the state read by q and k (2·C K V), the state update (C K V), and the intra-chunk
    output A_qk V_new (C²V); 2 FLOPs a MAC."""
    c = CHUNK
    per_chunk = 2 * (2 * c * c * DK + c**3 / 3 + c * c * DK + 2 * c * c * DV + 3 * c * DK * DV)
    return heads * (tokens / c) * per_chunk


def _to_torch(q, k, v, g, beta):
    """The KDA inputs as CUDA tensors the way fla takes them: q, k, v in bf16, g and beta in float32."""
    import torch

    tq, tk, tv = (torch.from_numpy(np.asarray(x, np.float32)).cuda().bfloat16() for x in (q, k, v))
    return tq, tk, tv, torch.from_numpy(np.asarray(g)).cuda(), torch.from_numpy(np.asarray(beta)).cuda()


def fla_ops():
    try:
        import torch
        from fla.ops.kda import chunk_kda, fused_recurrent_kda

        return torch, chunk_kda, fused_recurrent_kda
    except Exception as e:  # noqa: BLE001 — any import failure means "no baseline in this run"
        print(f"fla baseline unavailable: {type(e).__name__}: {e}")
        return None


def row(case, shape, impl, ms, flops, nbytes, bw, rate, err=None) -> dict:
    check = "" if err is None else f"rel err {err:.1e}"
    return roofline_row(case, shape, impl, ms, flops, nbytes, bw, rate, check)


STEPS = 20


def _decode_loop(kw, q, k, v, g, beta, state):
    """STEPS decode steps carrying the state (inputs reused: the state traffic is what is measured)."""

    def body(_, carry):
        o, s = kda_decode_step(q, k, v, g, beta, carry[1], **kw)
        return o, s

    return jax.lax.fori_loop(0, STEPS, body, (jnp.zeros(v.shape, q.dtype), state))


def _donating_loop(step, args, box):
    """A call that consumes the previous state (donated) and keeps the new one for the next call."""
    o, box["s"] = step(*args, box["s"])
    return o


def decode_rows(bw, rate, fla) -> list[dict]:
    rows = []
    for b in (1, 64, 256):
        ks = jax.random.split(jax.random.key(b), 6)
        q, k, v = (jax.random.normal(x, (b, N, DK), jnp.bfloat16) for x in ks[:3])
        g = -jax.nn.softplus(jax.random.normal(ks[3], (b, N, DK)))
        beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, N)))
        s0 = jax.random.normal(ks[5], (b, N, DK, DV)) * 0.1
        state_bytes = 2 * s0.nbytes
        io_bytes = 3 * q.nbytes + g.nbytes + beta.nbytes + q.nbytes
        flops = b * N * DK * DV * 8  # decay, k·S, rank-1 update, q·S
        ref_o, ref_s = jax.jit(lambda *a: kda_decode_step(*a, impl="reference"))(q, k, v, g, beta, s0)
        shape = f"B={b} N={N} K={DK} V={DV}"
        variants = {"jnp reference (XLA)": dict(impl="reference")}
        for bv, nw in ((32, 1), (32, 2), (32, 4), (64, 2), (64, 4), (64, 8), (128, 4), (128, 8)):
            variants[f"pallas, block_v={bv}, warps={nw}"] = dict(impl="pallas", block_v=bv, num_warps=nw)
        for name, kw in variants.items():
            o, s = jax.jit(lambda *a, kw=kw: kda_decode_step(*a, **kw))(q, k, v, g, beta, s0)
            err = max(rel_err(o, ref_o), rel_err(s, ref_s))
            # STEPS steps inside one executable (as generate's loop runs them): no host dispatch in the time.
            loop = jax.jit(functools.partial(_decode_loop, kw), donate_argnums=5)
            box = {"s": s0.copy()}
            ms = median_ms(functools.partial(_donating_loop, loop, (q, k, v, g, beta), box), iters=10) / STEPS
            rows.append(row("decode step", shape, name, ms, flops, state_bytes + io_bytes, bw, rate, err))
        if fla is not None:
            torch, _, fused_recurrent_kda = fla
            tq, tk, tv, tg, tb = (x[:, None] for x in _to_torch(q, k, v, g, beta))  # one token: T = 1
            ts = torch.from_numpy(np.asarray(s0)).cuda()
            o, _ = fused_recurrent_kda(tq, tk, tv, tg, tb, initial_state=ts.clone(), output_final_state=True,
                                       use_qk_l2norm_in_kernel=True)  # fmt: skip
            err = rel_err(o[:, 0].float().cpu().numpy(), ref_o)
            call = functools.partial(
                fused_recurrent_kda, tq, tk, tv, tg, tb, initial_state=ts.clone(), output_final_state=True,
                use_qk_l2norm_in_kernel=True, inplace_final_state=True,
            )  # fmt: skip
            graph = torch.cuda.CUDAGraph()  # STEPS launches replayed as one graph: no launch gaps either
            call()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                for _ in range(STEPS):
                    call()
            ms = torch_median_ms(graph.replay, iters=10) / STEPS
            rows.append(
                row("decode step", shape, "fla fused_recurrent_kda", ms, flops, state_bytes + io_bytes, bw, rate, err)
            )
    return rows


def _unfused_layer(*args):
    """The model's unfused decode token of a KDA layer: XLA's conv / gates / gated norm around the Pallas
    state-update kernel (what `hybrid_jax.layers.kda` runs without the fused layer kernel)."""
    from pallas_kernels.linear_attention.reference import kda_decode_layer_reference

    step = functools.partial(kda_decode_step, impl="pallas")
    return kda_decode_layer_reference(*args, num_heads=N, head_dim=DK, eps=1e-5, step=step)


def _layer_loop(step, args):
    """STEPS decode tokens of one layer carrying the conv state and the state (inputs reused), the outputs
    summed so that nothing is dropped."""

    def body(_, carry):
        conv, s, acc = carry
        y, conv, s = step(*args[:3], conv, *args[4:11], s, *args[12:])
        return conv, s, acc + y[0, 0, 0].astype(jnp.float32)

    conv, s, acc = jax.lax.fori_loop(0, STEPS, body, (args[3], args[11], jnp.float32(0)))
    return acc, conv, s


def layer_rows(bw, rate) -> list[dict]:
    """A KDA layer's decode token between its projections and o_proj: the fused layer kernel against the
    model's unfused step (XLA's ~8 small kernels around the state-update kernel), STEPS per executable."""
    from pallas_kernels.linear_attention import kda_decode_layer

    rows = []
    for b in (1, 16, 64):
        ks = iter(jax.random.split(jax.random.key(100 + b), 16))
        c = N * DK
        raw = [jax.random.normal(next(ks), (b, c), jnp.bfloat16) for _ in range(4)]
        conv_state = jax.random.normal(next(ks), (b, 3, 3 * c), jnp.bfloat16)
        conv_weights = tuple(jax.random.normal(next(ks), (4, c)) * 0.5 for _ in range(3))
        f = jax.random.normal(next(ks), (b, c), jnp.bfloat16)
        a_log = jax.random.uniform(next(ks), (N,), minval=-1.0, maxval=1.0)
        dt_bias = jax.random.normal(next(ks), (c,)) * 0.5
        b_logits = jax.random.normal(next(ks), (b, N), jnp.bfloat16)
        state = jax.random.normal(next(ks), (b, N, DK, DV)) * 0.1
        valid, n_new = jnp.ones((b,), bool), jnp.ones((b,), jnp.int32)
        q, k, v, z = raw
        args = (q, k, v, conv_state, conv_weights, f, a_log, dt_bias, b_logits, z, jnp.ones((DK,)), state, valid,
                n_new)  # fmt: skip
        fused = functools.partial(kda_decode_layer, num_heads=N, head_dim=DK, eps=1e-5, impl="pallas")
        ref = jax.jit(_unfused_layer)(*args)
        nbytes = 2 * state.nbytes + 2 * conv_state.nbytes + 5 * q.nbytes
        flops = b * N * DK * DV * 8
        shape = f"B={b} N={N} K={DK} V={DV} conv 4"
        for name, step in (("unfused (XLA glue + Pallas state step)", _unfused_layer), ("fused layer kernel", fused)):
            out = jax.jit(step)(*args)
            err = max(rel_err(out[0], ref[0]), rel_err(out[2], ref[2]))
            loop = jax.jit(functools.partial(_layer_loop, step))
            ms = median_ms(functools.partial(loop, args), iters=10) / STEPS
            rows.append(row("decode layer", shape, name, ms, flops, nbytes, bw, rate, err))
    return rows


GATE_SCALE = 0.1  # prefill rows' log decays: -GATE_SCALE * softplus(N(0, 1)) per element

PREFILL_VARIANTS = ((32, 4), (64, 4), (64, 8), (128, 8))


def _intra_phase(q, k, v, g, beta, *, parts=None):
    """Phase 1 of the Pallas prefill alone (its intermediates are the output), optionally with only some of
    its parts (`chunked.PARTS`; the others replaced by zeros / the identity) or, with parts="cumsum", only the
    chunk cumsum that precedes it. The A kernel's block forms as `kda`'s default (`tuning.A_BLOCKS`)."""
    from pallas_kernels._pallas import triton_params
    from pallas_kernels.linear_attention.chunked import INTRA_WARPS, PARTS, _chunk_cumsum, _intra

    interpret = jax.default_backend() == "cpu"
    if parts == "cumsum":
        return _chunk_cumsum(g, interpret=interpret, params=triton_params(interpret, INTRA_WARPS[0], 2))
    return _intra(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, l2norm=True, precision="bf16", interpret=interpret,
                  parts=PARTS if parts is None else frozenset(parts), a_blocks=kda_tuning.A_BLOCKS)  # fmt: skip


# --phases rows: phase 1 with some parts only (what the missing parts cost), and the cumsum kernel alone
PHASE_PARTS = (
    (None, "pallas phase 1 only (intra-chunk)"),
    (("solve",), "phase 1 without the decayed products of A"),
    (("levels",), "phase 1 without the inverse"),
    ((), "phase 1 loads + stores only"),
    ("cumsum", "chunk cumsum kernel only"),
)


def parse_variant(text: str) -> tuple[int, int, str, str]:
    """Variant text, e.g. 64x4, 64x4:bf16 or 64x4:bf16:substitution -> (block_v, num_warps, precision,
    solve)."""
    shape, prec, solve = (text.split(":") + ["", ""])[:3]
    bv, nw = (int(x) for x in shape.split("x"))
    return bv, nw, prec or "tf32", solve or "neumann"


def prefill_rows(
    bw, rate, fla, lengths, variants=None, phases=False, heads=(N,), mosaic=False, a_blocks=None, gate_scale=GATE_SCALE,
) -> list[dict]:  # fmt: skip
    """mosaic: also `kda(impl="mosaic")` (phase 1's Triton kernels, the Mosaic GPU state pass; bf16 products),
    and with a_blocks (not None) a second such row with `kda(a_blocks=)` (the A kernel's block forms; (): the
    binary split alone). gate_scale: the log decays are -gate_scale * softplus(N(0, 1)) per element (the default
    0.1 keeps a chunk's decay span small; larger scales push the A kernel's block forms onto the binary split)."""
    variants = variants or [(bv, nw, "tf32", "neumann") for bv, nw in PREFILL_VARIANTS]
    rows = []
    for n, t in ((n, t) for n in heads for t in lengths):
        ks = jax.random.split(jax.random.key(t + n), 5)
        q, k, v = (jax.random.normal(x, (1, t, n, DK), jnp.bfloat16) for x in ks[:3])
        g = -jax.nn.softplus(jax.random.normal(ks[3], (1, t, n, DK))) * gate_scale
        beta = jax.nn.sigmoid(jax.random.normal(ks[4], (1, t, n)))
        nbytes = 4 * q.nbytes + g.nbytes + beta.nbytes
        flops = prefill_flops(t, n)
        shape = f"B=1 T={t} N={n} K={DK} V={DV}" + (f" gates x{gate_scale:g}" if gate_scale != GATE_SCALE else "")
        ref = jax.jit(
            lambda q, k, v, g, beta: kda(q, k, v, g, beta, impl="reference", form="chunked", chunk_size=CHUNK)
        )
        ref_o, _ = ref(q, k, v, g, beta)
        ms = median_ms(lambda ref=ref, q=q, k=k, v=v, g=g, beta=beta: ref(q, k, v, g, beta), warmup=1, iters=3)
        rows.append(row("prefill", shape, "jnp reference (XLA, chunked)", ms, flops, nbytes, bw, rate))
        for bv, nw, prec, solve in variants:
            fn = jax.jit(functools.partial(kda, impl="pallas", block_v=bv, num_warps=nw, precision=prec, solve=solve))
            t0 = time.perf_counter()
            o, _ = jax.block_until_ready(fn(q, k, v, g, beta))
            print(f"  (T={t} pallas {bv}x{nw} {prec}: compile + first call {time.perf_counter() - t0:.1f} s)",
                  flush=True)  # fmt: skip
            err = rel_err(o, ref_o)
            ms = median_ms(functools.partial(fn, q, k, v, g, beta), 2, PREFILL_ITERS, PREFILL_CALLS)
            label = f"pallas chunked, block_v={bv}, warps={nw}" + (f", {prec} products" if prec != "tf32" else "")
            label += f", {solve}" if solve != "neumann" else ""
            rows.append(row("prefill", shape, label, ms, flops, nbytes, bw, rate, err))
        label = "Mosaic GPU state pass (Triton phase 1), bf16 products"  # "auto" on sm_90 (tuning.py)
        mosaic_rows = [(label, {})] if mosaic else []  # the defaults, as the other rows
        if mosaic and a_blocks is not None:
            forms = f", A block forms {','.join(map(str, a_blocks))}" if a_blocks else ", binary split"
            mosaic_rows.append((label + forms, {"a_blocks": a_blocks}))
        for label, options in mosaic_rows:
            fn = jax.jit(functools.partial(kda, impl="mosaic", **options))
            try:  # a failure to compile or run is a row, and the other rows stay
                err = rel_err(jax.block_until_ready(fn(q, k, v, g, beta))[0], ref_o)
                ms = median_ms(functools.partial(fn, q, k, v, g, beta), 2, PREFILL_ITERS, PREFILL_CALLS)
            except Exception as e:  # noqa: BLE001
                first = (str(e).splitlines() or [""])[0]
                print(f"  (T={t} {label}: did not run: {type(e).__name__}: {first})", flush=True)
                rows.append(roofline_row("prefill", shape, label, float("nan"), flops, nbytes, bw, rate,
                                         f"did not run: {type(e).__name__} (see log)"))  # fmt: skip
            else:
                rows.append(row("prefill", shape, label, ms, flops, nbytes, bw, rate, err))
        if phases:  # the intra-chunk phase alone (same inputs as the first variant): what the state pass costs
            for parts, label in PHASE_PARTS:
                intra = jax.jit(functools.partial(_intra_phase, parts=parts))
                jax.block_until_ready(intra(q, k, v, g, beta))
                ms = median_ms(functools.partial(intra, q, k, v, g, beta), warmup=1, iters=5)
                # a case of their own: parts of the prefill, not alternatives to it (the table's fastest)
                rows.append(row("prefill parts", shape, label, ms, flops, nbytes, bw, rate))
        if fla is not None:
            torch, chunk_kda, _ = fla
            tq, tk, tv, tg, tb = _to_torch(q, k, v, g, beta)
            o, _ = chunk_kda(tq, tk, tv, tg, tb, output_final_state=True, use_qk_l2norm_in_kernel=True)
            err = rel_err(o.float().cpu().numpy(), ref_o)
            call = functools.partial(
                chunk_kda, tq, tk, tv, tg, tb, output_final_state=True, use_qk_l2norm_in_kernel=True
            )
            ms = torch_median_ms(call, 2, PREFILL_ITERS, PREFILL_CALLS)
            rows.append(row("prefill", shape, "fla chunk_kda", ms, flops, nbytes, bw, rate, err))
    return rows


def varlen_offsets(total: int, seqs: int = 8) -> np.ndarray:
    """Cumulative offsets [seqs + 1] of the benchmark's packed batch: `total` tokens cut at seqs - 1 random
    places (a fixed seed: every run and `profile_stage` see the same lengths)."""
    rng = np.random.default_rng(0)
    cuts = np.sort(rng.choice(np.arange(1, total), seqs - 1, replace=False))
    return np.concatenate([[0], cuts, [total]])


def varlen_rows(bw, rate, fla, total: int, seqs: int = 8, n: int = N, mosaic: bool = False) -> list[dict]:
    """An 8-sequence variable-length batch packed along time (cumulative offsets), `total` tokens in all:
    `impl="pallas"` (the chunk-aligned packing, one Triton state-pass program per sequence) and with `mosaic`
    `impl="mosaic"` (the same with one Mosaic GPU program per sequence: what "auto" runs on sm_90)."""
    cu = varlen_offsets(total, seqs)
    ks = jax.random.split(jax.random.key(total + 1), 5)
    q, k, v = (jax.random.normal(x, (1, total, n, DK), jnp.bfloat16) for x in ks[:3])
    g = -jax.nn.softplus(jax.random.normal(ks[3], (1, total, n, DK))) * 0.1
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (1, total, n)))
    nbytes = 4 * q.nbytes + g.nbytes + beta.nbytes
    flops = prefill_flops(total, n)
    shape = f"{seqs} seqs, {total} tokens (longest {int(np.diff(cu).max())}), N={n} K={DK} V={DV}"
    rows = []
    ref = jax.jit(functools.partial(kda, impl="reference", form="chunked", chunk_size=CHUNK, cu_seqlens=cu))
    ref_o, _ = ref(q, k, v, g, beta)
    ms = median_ms(functools.partial(ref, q, k, v, g, beta), warmup=1, iters=3)
    rows.append(row("prefill varlen", shape, "jnp reference (XLA, chunked)", ms, flops, nbytes, bw, rate))
    fn = jax.jit(functools.partial(kda, impl="pallas", cu_seqlens=cu))  # defaults: bf16 products for bf16 inputs
    err = rel_err(fn(q, k, v, g, beta)[0], ref_o)
    ms = median_ms(functools.partial(fn, q, k, v, g, beta), 2, PREFILL_ITERS, PREFILL_CALLS)
    impl = "pallas chunked, packed chunk-aligned (defaults)"
    rows.append(row("prefill varlen", shape, impl, ms, flops, nbytes, bw, rate, err))
    if mosaic:
        fn = jax.jit(functools.partial(kda, impl="mosaic", cu_seqlens=cu))
        err = rel_err(fn(q, k, v, g, beta)[0], ref_o)
        ms = median_ms(functools.partial(fn, q, k, v, g, beta), 2, PREFILL_ITERS, PREFILL_CALLS)
        impl = "Mosaic GPU state pass (Triton phase 1), one program per sequence"
        rows.append(row("prefill varlen", shape, impl, ms, flops, nbytes, bw, rate, err))
    if fla is not None:
        torch, chunk_kda, _ = fla
        tq, tk, tv, tg, tb = _to_torch(q, k, v, g, beta)
        tcu = torch.from_numpy(cu).cuda()
        call = functools.partial(
            chunk_kda, tq, tk, tv, tg, tb, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=tcu
        )
        err = rel_err(call()[0].float().cpu().numpy(), ref_o)
        ms = torch_median_ms(call, 2, PREFILL_ITERS, PREFILL_CALLS)
        rows.append(row("prefill varlen", shape, "fla chunk_kda", ms, flops, nbytes, bw, rate, err))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--only", choices=("decode", "layer", "prefill"))
    p.add_argument("--prefill-lens", type=int, nargs="+", default=[4096, 32768, 131072])
    p.add_argument("--varlen-total", type=int, default=32768, help="tokens of the 8-sequence varlen batch (0: none)")
    p.add_argument("--heads", type=int, nargs="+", default=[N], help="KDA head counts of the prefill rows")
    p.add_argument(
        "--variants", nargs="+", default=[f"{bv}x{nw}" for bv, nw in PREFILL_VARIANTS],
        help="Pallas prefill variants as block_v x num_warps [:precision [:solve]], e.g. 64x4, 64x4:bf16 or "
        "64x4:bf16:substitution",
    )  # fmt: skip
    p.add_argument("--phases", action="store_true", help="also time the Pallas prefill's phase 1 alone")
    p.add_argument(
        "--gate-scale", type=float, default=GATE_SCALE,
        help=f"prefill rows' log decays (not varlen's): -scale * softplus(N(0, 1)), default {GATE_SCALE:g}",
    )  # fmt: skip
    a_help = "with --mosaic, also a row with kda(a_blocks=...): sizes as 64,16, or 'split' (the binary split alone)"
    p.add_argument("--a-blocks", default=None, help=a_help)
    p.add_argument(
        "--mosaic", action="store_true", help="also time kda(impl='mosaic'): the state pass in Mosaic GPU (sm_90)"
    )
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args()
    if args.a_blocks is not None and not args.mosaic:
        p.error(f"--a-blocks={args.a_blocks!r} adds a Mosaic GPU row: it needs --mosaic")
    a_blocks = () if args.a_blocks == "split" else args.a_blocks  # None: no such row
    if isinstance(a_blocks, str):
        try:
            a_blocks = tuple(int(x) for x in a_blocks.split(","))
            check_a_blocks(a_blocks, "kda")
        except ValueError:
            sizes = f"sizes from {A_BLOCK_SIZES}, largest first (e.g. 64,16), or split"
            p.error(f"--a-blocks={args.a_blocks!r} must be {sizes}")
    if not 0 < args.gate_scale < float("inf"):
        p.error(f"--gate-scale={args.gate_scale} must be finite and > 0")
    bw, rate = ceilings()
    print(f"measured ceilings: HBM {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
    fla = fla_ops()
    rows = []
    if args.only in (None, "decode"):
        rows += decode_rows(bw, rate, fla)
    if args.only in (None, "layer"):
        rows += layer_rows(bw, rate)
    if args.only in (None, "prefill"):
        variants = [parse_variant(v) for v in args.variants]
        rows += prefill_rows(bw, rate, fla, args.prefill_lens, variants, args.phases, args.heads, args.mosaic, a_blocks,
                             args.gate_scale)  # fmt: skip
        if args.varlen_total:
            rows += varlen_rows(bw, rate, fla, args.varlen_total, n=args.heads[0], mosaic=args.mosaic)
    title = (
        f"KDA kernels (N={N} heads, K=V={DK}); ceilings measured in this run: HBM {bw / 1e12:.2f} TB/s, "
        f"bf16 matmul {rate / 1e12:.0f} TFLOP/s"
    )
    report("linear_attention.py", title, rows, record=not args.no_record)


if __name__ == "__main__":
    main()
