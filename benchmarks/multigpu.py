"""CP x TP on several GPUs: time to first token of a long prompt under context parallelism (zigzag against
the sequential split) and decode throughput under tensor parallelism, with outputs checked against the
smallest mesh of the run. One table; rows go to benchmarks/results/.

    python -m benchmarks.multigpu [--config hybrid_small] [--layers N] [--prompt-len 131072] [--cps 1 2 4 8]
                                  [--cp-tp 2x4 4x2] [--tps 1 2 4 8] [--batch 16] [--context 2048]

Mesh shapes that need more devices than the machine has are skipped (and listed). Goals (issue 9): prefill
speed-up >= 0.8 x cp up to cp = 4, zigzag >= 1.3x the sequential split at cp = 4 on sparse-heavy configs,
outputs equal to the one-device run.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.common import report
from benchmarks.gpu_parity import cut_config
from benchmarks.sharded_overhead import interleaved_medians, rel_err
from hybrid_jax import PRESETS, HybridLM
from sharding import make_mesh, shard_params
from sharding.context_parallel import prefill_context_parallel


def _decode_loop(model, tok, cache, steps: int):
    """`steps` greedy decode steps inside one executable (as generate's loop runs them)."""

    def body(_, carry):
        tok, cache = carry
        logits, cache = model.decode_step(tok, cache)
        return jnp.argmax(logits, -1).astype(tok.dtype), cache

    return jax.lax.fori_loop(0, steps, body, (tok, cache))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", default="hybrid_small", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=None, help="a preset cut to this many layers (gpu_parity.cut_config)")
    p.add_argument("--prompt-len", type=int, default=131072)
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--cp-tp", nargs="+", default=["2x4", "4x2"], help="CP x TP prefill meshes, e.g. 2x4")
    p.add_argument("--tps", type=int, nargs="+", default=[1, 2, 4, 8], help="TP sizes for decode")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args()

    cfg = PRESETS[args.config]()
    if args.layers is not None:
        if args.layers < 1:
            raise SystemExit(f"--layers must be >= 1, got {args.layers}")
        cfg = cut_config(cfg, args.layers, cfg.num_experts)
    dtype = jnp.dtype(args.dtype)
    n_dev = jax.device_count()
    skipped, rows = [], []
    t = args.prompt_len
    ids = jax.random.randint(jax.random.key(1), (1, t), 0, cfg.vocab_size, jnp.int32)

    prefill_meshes = [(cp, 1, layout) for cp in args.cps for layout in ("zigzag", "sequential")]
    prefill_meshes += [(int(a), int(b), "zigzag") for a, b in (s.split("x") for s in args.cp_tp)]
    base_ms, base_logits = None, None
    for cp, tp, layout in prefill_meshes:
        if cp * tp > n_dev:
            skipped.append(f"prefill cp={cp} tp={tp}")
            continue
        if cp == 1 and layout == "sequential":
            continue  # the same split as zigzag at cp = 1
        mesh = make_mesh(cp=cp, tp=tp, devices=jax.devices()[: cp * tp])
        model = shard_params(HybridLM(cfg, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0)), mesh)
        cache = model.init_cache(1, t)
        run = functools.partial(prefill_context_parallel, model, ids, cache, mesh=mesh, layout=layout, last_only=True)
        logits = jax.block_until_ready(run())[0]
        ms = interleaved_medians({"x": run}, warmup=1, iters=args.iters)["x"]
        if base_ms is None:
            base_ms, base_logits = ms, logits
        rows.append(
            {
                "case": f"prefill {t} tokens (TTFT)",
                "mesh": f"cp={cp} tp={tp}" + (f" ({layout})" if cp > 1 else ""),
                "median ms": f"{ms:.1f}",
                "speed-up vs first": f"{base_ms / ms:.2f}x",
                "tokens/s": f"{t / ms * 1e3:,.0f}",
                "check vs first": f"last logits rel err {rel_err(logits, base_logits):.1e}",
            }
        )
        del model, cache

    b, ctx = args.batch, args.context
    ctx_ids = jax.random.randint(jax.random.key(2), (b, ctx), 0, cfg.vocab_size, jnp.int32)
    base_ms, base_tokens = None, None
    for tp in args.tps:
        if tp > n_dev:
            skipped.append(f"decode tp={tp}")
            continue
        mesh = make_mesh(tp=tp, devices=jax.devices()[:tp])
        model = shard_params(HybridLM(cfg, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0)), mesh)
        with jax.set_mesh(mesh):
            prefill = jax.jit(lambda m, i, c: m.prefill(i, c, last_only=True))
            logits, cache = prefill(model, ctx_ids, model.init_cache(b, ctx + args.decode_steps + 1))
            tok = jnp.argmax(logits, -1).astype(jnp.int32)
            loop = jax.jit(functools.partial(_decode_loop, steps=args.decode_steps))
            tokens = np.asarray(jax.block_until_ready(loop(model, tok, cache))[0])

            def run(model=model, tok=tok, cache=cache, loop=loop):
                return loop(model, tok, cache)

            ms = interleaved_medians({"x": run}, warmup=1, iters=args.iters)["x"] / args.decode_steps
        if base_ms is None:
            base_ms, base_tokens = ms, tokens
        rows.append(
            {
                "case": f"decode step, B={b}, {ctx}-token context",
                "mesh": f"tp={tp}",
                "median ms": f"{ms:.2f}",
                "speed-up vs first": f"{base_ms / ms:.2f}x",
                "tokens/s": f"{b / ms * 1e3:,.0f}",
                "check vs first": "same greedy tokens" if (tokens == base_tokens).all() else "TOKENS DIFFER",
            }
        )
        del model, cache
    if skipped:
        print(f"skipped (need more than {n_dev} devices): {', '.join(skipped)}")
    model_name = args.config + (f" cut to {cfg.num_layers} layers" if args.layers is not None else "")
    title = f"CP x TP on {n_dev} devices, {model_name}, {args.dtype}"
    report("multigpu.py", title, rows, record=not args.no_record)


if __name__ == "__main__":
    main()
