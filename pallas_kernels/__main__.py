"""`python -m pallas_kernels [--preset NAME] [--batch B --tokens T] [--backend gpu]`: what runs for each op of a
model, and why.

The model's prefill of B x T tokens and one decode step after them are traced abstractly (`jax.eval_shape`: no
weights, no device memory, any size) while `registry.record()` collects every dispatch decision; the table
lists each (phase, op, decision) once with how many calls made it. `--backend gpu` decides as on an sm_90 GPU
(H100 / H200) from any machine; the default decides for this machine's backend.
"""

from __future__ import annotations

import argparse
import contextlib
import sys


def _model_calls(preset: str, batch: int, tokens: int, quant_path: str | None, dtype: str):
    """[(phase, op, Choice, facts)] from tracing prefill and one decode step of the preset, abstractly."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from hybrid_jax.config import PRESETS
    from hybrid_jax.model import HybridLM
    from hybrid_jax.quant.config import QuantConfig
    from pallas_kernels import registry

    cfg = PRESETS[preset]()
    quant = QuantConfig.from_yaml(quant_path) if quant_path else None
    dt = jnp.dtype(dtype)
    abstract = nnx.eval_shape(lambda: HybridLM(cfg, dtype=dt, param_dtype=dt, quant=quant, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    max_len = tokens + 1

    def prefill(state, ids):
        model = nnx.merge(graphdef, state)
        cache = model.init_cache(batch, max_len)
        return model.prefill(ids, cache, last_only=True)

    def decode(state, ids):
        model = nnx.merge(graphdef, state)
        cache = model.init_cache(batch, max_len)
        cache = cache.replace(lengths=jnp.full((batch,), tokens, jnp.int32))
        return model.decode_step(ids[:, 0], cache)

    ids = jax.ShapeDtypeStruct((batch, tokens), jnp.int32)
    calls = []
    for phase, fn, x in (
        (f"prefill B={batch} T={tokens}", prefill, ids),
        (f"decode B={batch} after {tokens}", decode, jax.ShapeDtypeStruct((batch, 1), jnp.int32)),
    ):
        with registry.record() as records:
            jax.eval_shape(fn, state, x)
        calls += [(phase, op, choice, facts) for op, choice, facts in records]
    return calls


def _table(calls) -> list[tuple[str, str, str, str]]:
    """One row per distinct (phase, op, decision, reason), in first-seen order: (phase, function, runs, why)."""
    from pallas_kernels.registry import TABLE

    rows = (((phase, TABLE[op].function, str(choice), choice.reason)) for phase, op, choice, _ in calls)
    return list(dict.fromkeys(rows))


def main(argv: list[str] | None = None) -> int:
    from hybrid_jax.config import PRESETS

    p = argparse.ArgumentParser(prog="python -m pallas_kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="hybrid_small", choices=sorted(PRESETS), help="model (default hybrid_small)")
    p.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    p.add_argument("--tokens", type=int, default=4096, help="prompt tokens; decode runs after them (default 4096)")
    p.add_argument(
        "--backend",
        choices=("here", "gpu", "cpu"),
        default="here",
        help="decide for this machine (default), an sm_90 GPU, or a CPU",
    )
    p.add_argument("--quant", default=None, help="QuantConfig YAML (e.g. configs/quant_hierarchical.yaml)")
    p.add_argument("--dtype", default="bfloat16", help="compute and parameter dtype (default bfloat16)")
    args = p.parse_args(argv)
    for name in ("batch", "tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)} must be at least 1")

    import jax

    from pallas_kernels import registry

    device = {"gpu": registry.assume_device("gpu", "9.0"), "cpu": registry.assume_device("cpu")}
    try:
        with device.get(args.backend, contextlib.nullcontext()):
            where = "sm_90 GPU (assumed)" if args.backend == "gpu" else registry.backend()
            calls = _model_calls(args.preset, args.batch, args.tokens, args.quant, args.dtype)
    except (ValueError, OSError) as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    print(f"{args.preset}, {args.dtype}, decisions for: {where} (jax {jax.__version__})")
    header = ("phase", "function", "runs", "why")
    rows = [header, *_table(calls)]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row[:3], widths, strict=True)) + "  " + row[3])
    return 0


if __name__ == "__main__":
    sys.exit(main())
