"""Cost of the sharded code path on one device: a one-device (dp, cp, tp) mesh against the plain model.

Three paths over the same weights: the plain model under `jax.jit`; the parameters placed by
`sharding.shard_params` on a one-device mesh and run under `jax.set_mesh` (activation constraints active);
and the context-parallel prefill (`sharding.context_parallel.prefill_context_parallel`, cp = 1), which also
fills the decode cache. Timings alternate between paths (warm-up first, medians) so drift hits all alike.
Goal (issue 7): the sharded paths equal the plain one and cost at most 5% more time.

    python -m benchmarks.sharded_overhead [--config hybrid_small] [--prompt-len 4096] [--batch 16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.common import report
from hybrid_jax import PRESETS, HybridLM
from sharding import make_mesh, shard_params
from sharding.context_parallel import prefill_context_parallel


def interleaved_medians(fns: dict, warmup: int = 2, iters: int = 7) -> dict[str, float]:
    """Median ms of each zero-argument callable, timing them in turn so they share the machine's drift."""
    for fn in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn())
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(iters):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    norm = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / norm) if norm else float(np.abs(a).max(initial=0.0))


def equality_check(cfg, mesh, prefill, decode, t: int) -> dict:
    """The three paths in float32 at the highest matmul precision on a short prompt: errors against the plain
    model for the logits and the worst cache leaf (bf16 runs of a random model differ by rounding noise
    that the layers amplify, so equality is checked where rounding is small)."""
    with jax.default_matmul_precision("highest"):
        plain = HybridLM(cfg, rngs=nnx.Rngs(0))
        sharded = shard_params(HybridLM(cfg, rngs=nnx.Rngs(0)), mesh)
        ids = jax.random.randint(jax.random.key(3), (2, t), 0, cfg.vocab_size, jnp.int32)
        cache = plain.init_cache(2, t + 8)
        with jax.set_mesh(mesh):
            sharded_out = prefill(sharded, ids, cache)
        outs = {
            "plain": prefill(plain, ids, cache),
            "sharded, 1-device mesh": sharded_out,
            "context-parallel, cp=1": prefill_context_parallel(sharded, ids, cache, mesh=mesh, last_only=True),
        }
        tok = ids[:, -1]
        with jax.set_mesh(mesh):
            sharded_step = decode(sharded, tok, outs["plain"][1])
        steps = {"plain": decode(plain, tok, outs["plain"][1]), "sharded, 1-device mesh": sharded_step}

    def describe(got, ref) -> str:
        cache_errs = [rel_err(a, b) for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(ref[1]), strict=True)]
        return f"{rel_err(got[0], ref[0]):.1e}; {max(cache_errs):.1e}"

    errors = {("prefill", k): describe(v, outs["plain"]) for k, v in outs.items()}
    errors.update({("decode", k): describe(v, steps["plain"]) for k, v in steps.items()})
    return errors


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", default="hybrid_small", choices=sorted(PRESETS))
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=16, help="decode batch")
    p.add_argument("--context", type=int, default=2048, help="cached tokens before the timed decode step")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--check-len", type=int, default=256, help="prompt length of the float32 equality check")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args()

    cfg = PRESETS[args.config]()
    mesh = make_mesh(devices=jax.devices()[:1])
    prefill = jax.jit(lambda m, ids, c: m.prefill(ids, c, last_only=True))
    decode = jax.jit(lambda m, ids, c: m.decode_step(ids, c))
    errors = equality_check(cfg, mesh, prefill, decode, args.check_len)
    print("float32 equality check (highest matmul precision):", errors, flush=True)

    dtype = jnp.dtype(args.dtype)
    plain = HybridLM(cfg, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
    sharded = shard_params(HybridLM(cfg, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0)), mesh)

    t = args.prompt_len
    ids = jax.random.randint(jax.random.key(1), (1, t), 0, cfg.vocab_size, jnp.int32)
    cache1 = plain.init_cache(1, t)

    def on_mesh(fn):
        def run():
            with jax.set_mesh(mesh):
                return fn()

        return run

    paths = {
        "plain": lambda: prefill(plain, ids, cache1),
        "sharded, 1-device mesh": on_mesh(lambda: prefill(sharded, ids, cache1)),
        "context-parallel, cp=1": lambda: prefill_context_parallel(sharded, ids, cache1, mesh=mesh, last_only=True),
    }
    ms = interleaved_medians(paths)
    rows = []
    for k in paths:
        rows.append(
            {
                "case": f"prefill {t} tokens, B=1 (+ cache fill)",
                "path": k,
                "median ms": f"{ms[k]:.2f}",
                "vs plain": f"{ms[k] / ms['plain']:.3f}x",
                "float32 rel err vs plain (logits; worst cache leaf)": errors[("prefill", k)],
            }
        )

    b, ctx = args.batch, args.context
    ctx_ids = jax.random.randint(jax.random.key(2), (b, ctx), 0, cfg.vocab_size, jnp.int32)
    _, cache = prefill(plain, ctx_ids, plain.init_cache(b, ctx + 8))
    tok = ctx_ids[:, -1]
    steps = {
        "plain": lambda: decode(plain, tok, cache),
        "sharded, 1-device mesh": on_mesh(lambda: decode(sharded, tok, cache)),
    }
    ms = interleaved_medians(steps, iters=21)
    for k in steps:
        rows.append(
            {
                "case": f"decode step, B={b}, {ctx}-token context",
                "path": k,
                "median ms": f"{ms[k]:.2f}",
                "vs plain": f"{ms[k] / ms['plain']:.3f}x",
                "float32 rel err vs plain (logits; worst cache leaf)": errors[("decode", k)],
            }
        )
    title = f"Sharded code path on a one-device mesh vs the plain model, {args.config}, {args.dtype} (goal <= 1.05x)"
    report("sharded_overhead.py", title, rows, record=not args.no_record)


if __name__ == "__main__":
    main()
