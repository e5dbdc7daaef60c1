"""End-to-end timing of the pure-JAX reference model (no Pallas kernels): prefill and decode step.

The baseline every later kernel issue is measured against. Prints one table; its rows go to
benchmarks/results/ with date, commit, device and shapes.

    python benchmarks/reference_e2e.py [--config hybrid_small] [--prompt-lens 1024 4096] [--batches 1 16]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.common import median_ms, report
from hybrid_jax import PRESETS, HybridLM
from hybrid_jax.quant.config import QuantConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", default="hybrid_small", choices=sorted(PRESETS))
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context", type=int, default=2048, help="cached tokens before the timed decode step")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quant", default=None, help="QuantConfig YAML (e.g. configs/quant_hierarchical.yaml)")
    p.add_argument("--no-record", action="store_true", help="print only; do not append to benchmarks/results")
    args = p.parse_args()

    cfg = PRESETS[args.config]()
    dtype = jnp.dtype(args.dtype)
    quant = QuantConfig.from_yaml(args.quant) if args.quant else None
    param_dtype = None if quant and quant.projection.param_dtype is not None else dtype
    model = HybridLM(cfg, dtype=dtype, param_dtype=param_dtype, quant=quant, rngs=nnx.Rngs(0))
    prefill = jax.jit(lambda m, ids, c: m.prefill(ids, c, last_only=True), donate_argnums=2)
    decode = jax.jit(lambda m, ids, c: m.decode_step(ids, c), donate_argnums=2)

    rows = []
    for t in args.prompt_lens:
        ids = jax.random.randint(jax.random.key(t), (1, t), 0, cfg.vocab_size, jnp.int32)

        def run_prefill(ids=ids, t=t):
            return prefill(model, ids, model.init_cache(1, t))

        ms = median_ms(run_prefill, warmup=2, iters=5)
        rows.append(
            {
                "case": "prefill (TTFT)",
                "batch": 1,
                "tokens": t,
                "median ms": f"{ms:.2f}",
                "tokens/s": f"{t / ms * 1e3:,.0f}",
            }
        )
    for b in args.batches:
        ctx = args.context
        ids = jax.random.randint(jax.random.key(b), (b, ctx), 0, cfg.vocab_size, jnp.int32)
        _, cache = prefill(model, ids, model.init_cache(b, ctx + 64))
        tok = ids[:, -1]
        # Each call consumes (donates) the cache and returns the next one, as the generate loop does.
        state = {"cache": cache}

        def step(tok=tok, state=state):
            logits, state["cache"] = decode(model, tok, state["cache"])
            return logits

        ms = median_ms(step, warmup=2, iters=20)
        rows.append(
            {
                "case": "decode step",
                "batch": b,
                "tokens": ctx,
                "median ms": f"{ms:.2f}",
                "tokens/s": f"{b / ms * 1e3:,.0f}",
            }
        )

    title = (
        f"Reference model (pure jnp, no Pallas), {args.config} ({cfg.layer_pattern}), {args.dtype} "
        f"activations; decode after a {args.context}-token context; quant: {args.quant or 'off'}"
    )
    report("reference_e2e.py", title, rows, record=not args.no_record)


if __name__ == "__main__":
    main()
