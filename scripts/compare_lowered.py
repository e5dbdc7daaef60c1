"""Fingerprints of what a model compiles to on a GPU, from a CPU: run in two checkouts to show a refactor left
the programs unchanged (same fingerprints = the same XLA program and the same Triton kernels).

    python scripts/compare_lowered.py [--preset hybrid_small] [--batches 1 16] [--context 2048] [--prefill 4096]

For each decode step (B sequences after `--context` tokens) and a prefill of `--prefill` tokens, the model is
traced abstractly with the decisions of an sm_90 GPU, lowered for an abstract H200 (no GPU needed), and two
hashes are printed: the outer StableHLO without debug locations and the Triton kernels' IR blobs, and the set of
Triton kernels (their IR without debug info, warps and stages). Source file paths and line numbers do not enter
either hash, so run both checkouts from the same path or not, as convenient.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout this script is in


def fingerprints(preset: str, batches: list[int], context: int, prefill: int) -> list[tuple[str, str, int, str]]:
    """[(case, outer hash, kernel count, kernels hash)]."""
    import jax.numpy as jnp
    from flax import nnx

    from benchmarks.kernel_resources import lower_for_h200, triton_kernels
    from hybrid_jax.config import PRESETS
    from hybrid_jax.model import HybridLM

    cfg = PRESETS[preset]()
    model = nnx.eval_shape(lambda: HybridLM(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    cases = [(f"decode B={b} after {context}", b, 1) for b in batches] + [(f"prefill B=1 T={prefill}", 1, prefill)]
    rows = []
    for name, b, t in cases:

        def fn(state, ids, b=b, t=t):
            m = nnx.merge(graphdef, state)
            cache = m.init_cache(b, max(context, t) + 1)
            if t == 1:
                cache = cache.replace(lengths=jnp.full((b,), context, jnp.int32))
                return m.decode_step(ids[:, 0], cache)
            return m.prefill(ids, cache, last_only=True)

        ids = jax.ShapeDtypeStruct((b, t), jnp.int32)
        kernels = sorted(
            f"{k['name']}|{k['num_warps']}|{k['num_stages']}|{k['ttir']}" for k in triton_kernels(fn, state, ids)
        )
        text = lower_for_h200(fn, state, ids, axis_types=(jax.sharding.AxisType.Auto,)).as_text(debug_info=False)
        text = re.sub(r'ir = "[^"]*"', 'ir = ""', text)  # the kernels' serialized IR holds source locations
        digest = lambda s: hashlib.sha1(s.encode()).hexdigest()[:12]  # noqa: E731
        rows.append((name, digest(text), len(kernels), digest("\n".join(kernels))))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="hybrid_small")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--prefill", type=int, default=4096)
    args = p.parse_args()
    jax.default_backend = lambda: "gpu"  # decide as on a GPU: every version of the dispatch rules reads this
    for name, outer, n, kernels in fingerprints(args.preset, args.batches, args.context, args.prefill):
        print(f"{name}: program {outer}, {n} Triton kernels {kernels}")


if __name__ == "__main__":
    main()
