"""Where the time of a prefill or a decode step goes: each stage of the model timed alone on the shapes the
full call gives it, multiplied by how many layers run it, beside the full call. Rows go to benchmarks/results/.

Stages: the mixer of one layer of each kind (KDA, dense MLA, sparse MLA with its indexer) through the
cache path, the FFN (MoE or dense SwiGLU), the final norm + lm_head. The per-layer numbers exclude the
norms and AttnRes mixes, so the sum is a little under the full call; what is left shows in the last row.
Decode stages and the full decode step are timed as 20 calls chained in one executable (`common.loop_ms`,
`common.decode_loop`): device time as inside `generate`'s loop, without the host's dispatch of each call; a
mixer's cache state is carried from call to call and donated (since 2026-11-30; before, it was a constant of
the loop and XLA copied it ahead of the in-place kernels, a little time generate does not spend).

    python -m benchmarks.e2e_stages [--model hybrid_small | --hf-dir FOLDER] [--prefill 32768] [--decode-batch 16]
        [--context 2048] [--no-record]
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks.common import decode_loop, loop_ms, median_ms, report
from hybrid_jax.cache import StepInfo
from pallas_kernels import use_pallas


def _info(cache, b: int, t: int, context: int, mode: str) -> StepInfo:
    lengths = jnp.full((b,), context, jnp.int32)
    return StepInfo(
        positions=lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :],
        valid=jnp.ones((b, t), bool),
        n_new=jnp.full((b,), t, jnp.int32),
        page_table=cache.page_table,
        kv_lengths=lengths + t,
        mode=mode,
    )


def stage_rows(model, b: int, t: int, context: int, label: str, iters: int) -> list[dict]:
    """Times of one call of each stage on [b, t] new tokens after `context` cached ones (the cache holds
    zeros: the cost does not depend on the values)."""
    cfg = model.config
    page = cfg.page_size
    n = 20 if t == 1 else 1  # decode stages: 20 chained calls per executable, no host dispatch in the time
    room = n * (iters + 1) if t == 1 else 0  # the full decode loop's own steps
    cache = model.init_cache(b, -(-(context + t + room) // page) * page)
    info = _info(cache, b, t, context, "decode" if t == 1 else "prefill")
    x = jax.random.normal(jax.random.key(0), (b, t, cfg.hidden_size), model.dtypes.compute)

    mixer = lambda mod, x, info, st: mod(x, info, st)  # noqa: E731
    ffn = lambda mod, x: mod(x)  # noqa: E731
    counts = collections.Counter()
    first = {}
    for i, layer in enumerate(model.layers):
        kind = {
            "linear": "KDA mixer", "full": "dense MLA mixer", "sparse": "sparse MLA + indexer mixer",
            "attention": "gated GQA mixer",
        }[layer.layer_type]  # fmt: skip
        ffn_kind = "MoE FFN" if cfg.mlp_types[i] == "moe" else "dense FFN"
        for k in (kind, ffn_kind):
            counts[k] += 1
            first.setdefault(k, i)
    rows, total = [], 0.0
    for name, i in first.items():
        layer = model.layers[i]
        if name.endswith("mixer"):
            state = jax.tree.map(jnp.copy, cache.layers[i])  # carried and donated: a copy, the cache is used below
            ms = loop_ms(mixer, layer.self_attn, x, info, state, n=n, reps=iters, carry=lambda out: out[1])
        else:
            ms = loop_ms(ffn, layer.mlp, x, n=n, reps=iters)
        total += ms * counts[name]
        rows.append({"stage": name, "layers": counts[name], "ms each": ms})
        if name == "KDA mixer" and t == 1:  # the decode step without the fused layer kernel, same input
            with use_pallas(False, ops=["kda_decode_layer"]):
                state = jax.tree.map(jnp.copy, cache.layers[i])
                ms_u = loop_ms(mixer, layer.self_attn, x, info, state, n=n, reps=iters, carry=lambda out: out[1])
            rows.append({"stage": "KDA mixer, fused layer kernel off (not in the sum)", "layers": counts[name],
                         "ms each": ms_u})  # fmt: skip
        if name == "MoE FFN":  # both expert paths forced on the same input (not in the sum; "auto" is above)
            for on, what in ((False, "XLA ragged_dot"), (True, "Pallas grouped matmul")):
                with use_pallas(on, ops=["moe"]):
                    ms_k = loop_ms(ffn, layer.mlp, x, n=n, reps=iters)
                rows.append({"stage": f"MoE FFN, {what} forced (not in the sum)", "layers": counts[name],
                             "ms each": ms_k})  # fmt: skip
    ms = loop_ms(lambda m, h: m._logits(m.norm(h)), model, x[:, -1], n=n, reps=iters)
    total += ms
    rows.append({"stage": "final norm + lm_head (last position)", "layers": 1, "ms each": ms})

    if t == 1:  # n steps in one executable, as generate's loop runs them
        steps = decode_loop(model, n)
        box = {"tok": jnp.zeros((b,), jnp.int32), "cache": cache}

        def full():
            box["tok"], box["cache"] = steps(box["tok"], box["cache"])
            return box["tok"]

        full_ms = median_ms(full, warmup=1, iters=iters) / n
    else:
        fresh = model.init_cache(b, cache.max_len)
        full_ms = loop_ms(lambda m, ids, c: m.prefill(ids, c, last_only=True)[0], model,
                          jnp.zeros((b, t), jnp.int32), fresh, n=1, reps=iters)  # fmt: skip
    out = []
    for r in rows:
        share = r["ms each"] * r["layers"]
        out.append(
            {
                "call": label, "stage": r["stage"], "layers": r["layers"], "ms each": f"{r['ms each']:.3f}",
                "ms x layers": f"{share:.2f}", "share of full call": f"{share / full_ms:.0%}",
            }
        )  # fmt: skip
    out.append(
        {
            "call": label, "stage": "full call (norms, AttnRes, embedding: the rest)", "layers": "",
            "ms each": "", "ms x layers": f"{full_ms:.2f}",
            "share of full call": f"{(full_ms - total) / full_ms:.0%} rest",
        }
    )  # fmt: skip
    for r in out:
        print("  " + " | ".join(str(v) for v in r.values()), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="hybrid_small", help="preset (random weights) unless --hf-dir")
    p.add_argument("--hf-dir", type=Path, default=None, help="a Hugging Face folder to load instead")
    p.add_argument("--prefill", type=int, nargs="*", default=[32768])
    p.add_argument("--decode-batch", type=int, nargs="*", default=[1, 16])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args()
    if args.hf_dir is not None:
        from checkpoints import from_pretrained

        model, name = from_pretrained(args.hf_dir, dtype=jnp.bfloat16, progress=False), str(args.hf_dir)
    else:
        from benchmarks.e2e import build_model

        model, name = build_model(args.model), args.model  # bf16 weights
    rows = []
    for t in args.prefill:
        rows += stage_rows(model, 1, t, 0, f"prefill B=1 T={t}", args.iters)
    for b in args.decode_batch:
        rows += stage_rows(model, b, 1, args.context, f"decode B={b} after {args.context}", args.iters)
    report("e2e_stages.py", f"Stage breakdown of {name} ({model.config.layer_pattern}), bfloat16", rows,
           record=not args.no_record)  # fmt: skip


if __name__ == "__main__":
    main()
