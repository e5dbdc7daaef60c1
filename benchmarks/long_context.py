"""Long context on one GPU: a preset (default the full Kimi-Linear-48B, random bf16 weights made on the device)
prefills one long prompt chunk by chunk through the caches, and decodes after it.

    python -m benchmarks.long_context [--preset kimi_linear_48b] [--lengths 32768 131072 524288 1048000]
        [--chunk 16384] [--batch-contexts 32768 131072] [--batches 16] [--layers 8] [--no-record]

- TTFT: one prompt of max(--lengths) tokens is prefilled --chunk tokens at a time (one compiled chunk step; the
  cache spans the whole prompt from the start, as `generate(prefill_chunk=)` does). Prefilling the first L
  tokens is the same work as a prompt of L tokens, so TTFT(L) is the time at which the chunk holding token L
  has finished (each chunk waited for). Floor: the counted FLOPs (`e2e.prefill_flops`) over the measured matmul
  rate, or the weight bytes over the measured HBM bandwidth if larger.
- Decode after L (batch 1): when the prefill reaches each L, 16 greedy steps in one executable (the loop
  `generate` compiles) on a copy of the cache; the prefill continues from the cache before them. Floor: the
  bytes one step must move (`e2e.decode_floor_bytes`) over the measured HBM bandwidth.
- Decode at each of --batches rows after each of --batch-contexts: the caches filled with random rows of the right
  length (no prefill: a step's cost depends on the lengths, not on the values), the same 16-step loop. Its floor
  counts the routed experts the 16 steps after the timed ones chose (`e2e.count_touched`, in the note beside what
  uniform routing would touch), not the uniform expectation.
- Peak: the device's peak bytes in use after each row (it only grows over a run).
- Memory: the script lets jax take 95% of the GPU (`XLA_CLIENT_MEM_FRACTION`, unless set).
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import jax
import jax.numpy as jnp

DECODE_STEPS = 16


# The random fill draws about this many float32 bytes at a time (a block of an array's leading axis, at least
# one row).
FILL_BYTES = 256 << 20


def _fill(x, key, block_bytes: int = FILL_BYTES):
    """x (floating) filled with 0.1 x normal values in its own dtype, block by block along its leading axis
    (blocks of at most `block_bytes` of float32 draws, or one row where a row is larger; the last block
    overlaps the one before it), written in place when x is donated: the temporary is one block, not a
    float32 copy of the whole array."""
    if x.size == 0:
        return x
    rows = x.shape[0] if x.ndim else 1
    y = x.reshape(rows, -1)
    block = max(1, min(rows, block_bytes // (4 * max(1, y.shape[1]))))

    def body(i, y):
        start = jnp.minimum(i * block, rows - block)
        v = 0.1 * jax.random.normal(jax.random.fold_in(key, i), (block, y.shape[1]), jnp.float32)
        return jax.lax.dynamic_update_slice_in_dim(y, v.astype(y.dtype), start, 0)

    return jax.lax.fori_loop(0, -(-rows // block), body, y).reshape(x.shape)


def _random_like(cache, key, block_bytes: int = FILL_BYTES):
    """The cache's arrays filled with small random values (pools, states); lengths and tables kept. One jitted
    call with the old arrays donated, each filled in place a block at a time (`_fill`): a float32 draw of a
    whole B=64 x 32K pool is a temporary of several GiB, which the full model's memory does not leave room for."""
    leaves, treedef = jax.tree.flatten(cache.layers)

    @functools.partial(jax.jit, donate_argnums=0)
    def fill(leaves):
        keys = jax.random.split(key, len(leaves))
        return [
            _fill(x, k, block_bytes) if jnp.issubdtype(x.dtype, jnp.floating) else x
            for k, x in zip(keys, leaves, strict=True)
        ]  # fmt: skip

    return cache.replace(layers=jax.tree.unflatten(treedef, fill(leaves)))


def _peak_gib() -> float | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats["peak_bytes_in_use"] / 2**30 if "peak_bytes_in_use" in stats else None


def _claim_gpu_memory(env) -> None:
    """The full model's 91.6 GiB of weights and a B=64 x 32K cache pass jax's default share of the H200 (75%):
    ask for 95%. Read when the GPU backend starts, so called before the first device call. A caller's setting
    under either name wins (jax refuses both names set together; XLA_PYTHON_CLIENT_MEM_FRACTION is the
    deprecated one)."""
    if not any(name in env for name in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")):
        env["XLA_CLIENT_MEM_FRACTION"] = "0.95"


def main() -> None:
    _claim_gpu_memory(os.environ)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="kimi_linear_48b")
    p.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072, 524288, 1048000])
    p.add_argument("--chunk", type=int, default=16384)
    p.add_argument("--batches", type=int, nargs="*", default=[16], help="rows of the random-filled decode rows")
    p.add_argument("--batch-contexts", type=int, nargs="*", default=[32768, 131072])
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="keep the first N layers (and the first of each kind they lack: gpu_parity.cut_config)",
    )
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args()
    from flax import nnx

    from benchmarks.common import ceilings, decode_loop, jit_module, report
    from benchmarks.e2e import _param_bytes, count_touched, decode_floor_bytes, prefill_flops
    from hybrid_jax.config import PRESETS
    from hybrid_jax.model import HybridLM

    cfg = PRESETS[args.preset]()
    if args.layers is not None:
        if args.layers < 1:
            raise SystemExit(f"--layers must be >= 1, got {args.layers}")
        from benchmarks.gpu_parity import cut_config

        cfg = cut_config(cfg, args.layers, cfg.num_experts)  # every expert kept: the weights a step reads
    total = max(args.lengths)
    if total + DECODE_STEPS + 1 > cfg.max_position_embeddings:
        raise SystemExit(
            f"--lengths {total} + {DECODE_STEPS + 1} decoded tokens exceed max_position_embeddings="
            f"{cfg.max_position_embeddings}"
        )
    bw, rate = ceilings()
    print(f"measured ceilings: HBM {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
    t0 = time.perf_counter()
    model = HybridLM(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    jax.block_until_ready(nnx.state(model))
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(f"{args.preset}: {params / 1e9:.2f} B parameters made in {time.perf_counter() - t0:.1f} s", flush=True)

    rows = []

    def emit(**r):
        rows.append(r)
        print("  " + " | ".join(f"{k}={v}" for k, v in r.items()), flush=True)

    weights = _param_bytes(model)[0]
    chunk = args.chunk
    n_chunks = -(-total // chunk)
    ids = jax.random.randint(jax.random.key(1), (1, n_chunks * chunk), 0, cfg.vocab_size, jnp.int32)
    step = jit_module(lambda m, i, c, n: m.prefill(i, c, n, last_only=True), model, donate_argnums=1)
    loop = decode_loop(model, DECODE_STEPS)
    count_loop = decode_loop(model, DECODE_STEPS, count_experts=True) if "moe" in cfg.mlp_types else None
    cache = model.init_cache(1, total + DECODE_STEPS + 1)
    # compile the chunk step and the decode loop before the clock runs (on throwaway caches of the same shapes)
    warm = step(ids[:, :chunk], model.init_cache(1, total + DECODE_STEPS + 1), jnp.array([chunk], jnp.int32))
    jax.block_until_ready(loop(jnp.zeros((1,), jnp.int32), warm[1]))
    del warm
    marks = sorted(args.lengths)
    elapsed, done = 0.0, 0
    for i in range(n_chunks):
        n = min(chunk, total - done)
        t0 = time.perf_counter()
        logits, cache = step(ids[:, i * chunk : (i + 1) * chunk], cache, jnp.array([n], jnp.int32))
        jax.block_until_ready(logits)
        elapsed += time.perf_counter() - t0
        done += n
        while marks and marks[0] <= done:
            length = marks.pop(0)
            floor = max(prefill_flops(model, length) / rate, weights / bw) * 1e3
            emit(case="TTFT (chunked prefill)", batch=1, tokens=length, ms=elapsed * 1e3, floor_ms=floor,
                 peak=_peak_gib(), note=f"{length // chunk} chunks of {chunk}" if length >= chunk else "")  # fmt: skip
            copy = jax.tree.map(jnp.copy, cache)
            tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            t1 = time.perf_counter()
            jax.block_until_ready(loop(tok, copy))
            ms = (time.perf_counter() - t1) * 1e3 / DECODE_STEPS
            emit(case="decode step (after the prefill)", batch=1, tokens=length, ms=ms,
                 floor_ms=decode_floor_bytes(model, cache, 1, length) / bw * 1e3, peak=_peak_gib(),
                 note=f"{DECODE_STEPS} steps per executable")  # fmt: skip
            del copy
    del cache
    for b, ctx in ((b, ctx) for ctx in args.batch_contexts for b in args.batches):
        cache = model.init_cache(b, ctx + 3 * DECODE_STEPS + 2)
        cache = _random_like(cache, jax.random.key(ctx)).replace(lengths=jnp.full((b,), ctx, jnp.int32))
        tok = jnp.zeros((b,), jnp.int32)
        tok, cache = loop(tok, cache)  # compile and warm
        jax.block_until_ready(tok)
        t1 = time.perf_counter()
        tok, cache = loop(tok, cache)
        jax.block_until_ready(tok)
        ms = (time.perf_counter() - t1) * 1e3 / DECODE_STEPS
        peak = _peak_gib()  # before the counting loop's executable
        tok, cache, touched, experts = count_touched(count_loop, model, b, tok, cache)
        emit(case="decode step (random-filled cache)", batch=b, tokens=ctx, ms=ms,
             floor_ms=decode_floor_bytes(model, cache, b, ctx, touched=touched) / bw * 1e3, peak=peak,
             note="; ".join(filter(None, [f"{DECODE_STEPS} steps per executable", experts])))  # fmt: skip
        del cache, tok
    table = [
        {
            "preset": args.preset, "case": r["case"], "batch": r["batch"], "tokens": r["tokens"],
            "median ms": f"{r['ms']:.2f}", "floor ms": f"{r['floor_ms']:.2f}",
            "x floor": f"{r['ms'] / r['floor_ms']:.2f}x" if r["floor_ms"] else "",
            "peak GiB": "" if r["peak"] is None else f"{r['peak']:.1f}", "note": r["note"],
        }
        for r in rows
    ]  # fmt: skip
    title = (
        f"Long context on one device ({args.preset}{f', {cfg.num_layers} layers' if args.layers else ''}, "
        f"{params / 1e9:.2f} B parameters, random bf16 weights); chunks of {chunk}; ceilings: HBM "
        f"{bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s"
    )
    report("long_context.py", title, table, record=not args.no_record)


if __name__ == "__main__":
    main()
