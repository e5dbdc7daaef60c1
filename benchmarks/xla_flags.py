"""Decode step time under XLA GPU compiler options: the decode loop `generate` compiles (greedy, cache
donated, `common.decode_loop`) compiled once per option set through `jax.jit(..., compiler_options=)`, so one
process times them all on the same weights and cache. Rows go to benchmarks/results/.

Why: a batch-1 decode step is a few hundred small kernels; what each launch costs beside its work depends on
whether XLA records the step into CUDA graphs (command buffers) and which ops it lets into them. The table
says which option set `hybrid_jax.compilation.DECODE_COMPILER_OPTIONS` should hold.

Columns: the option set, the median ms per step (n steps per executable, median of reps), the step's
byte floor (`e2e.decode_floor_bytes` over the measured HBM bandwidth), and the kernels one step launches,
counted in the optimized HLO (`kernel_count.count_kernels`: the loop body once, plus the few kernels around it).

`--pallas-ops` adds the opt-in kernels to compare in the same process: each entry a "+"-joined set of
`pallas_kernels.OPS` traced inside `use_pallas(ops=...)` ("none": the defaults), e.g.
`--variants default --pallas-ops none kda_decode_layer rms_norm kda_decode_layer+rms_norm`.

    python -m benchmarks.xla_flags [--models hybrid_small kimi] [--hf-dir FOLDER] [--batches 1 16]
        [--context 2048] [--variants default no_graphs ...] [--pallas-ops none OP+OP ...] [--no-record]
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks.common import ceilings, flat_module, jit_module, median_ms, report
from benchmarks.e2e import add_hf_args
from benchmarks.kernel_count import count_kernels

# name -> compiler options; names are what the table and --variants show.
_BASIC = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION"
_WHILE = _BASIC + ",WHILE,CONDITIONAL"  # the whole loop one graph (CUDA conditional nodes)
VARIANTS: dict[str, dict] = {
    "default": {},
    "no_graphs": {"xla_gpu_enable_command_buffer": ""},
    "graphs_basic": {"xla_gpu_enable_command_buffer": _BASIC},
    "graphs_min1": {"xla_gpu_graph_min_graph_size": 1},
    "graphs_while": {"xla_gpu_enable_command_buffer": _WHILE},
    "graphs_while_min1": {"xla_gpu_enable_command_buffer": _WHILE, "xla_gpu_graph_min_graph_size": 1},
    "graphs_while_unroll": {"xla_gpu_enable_command_buffer": _WHILE, "xla_gpu_command_buffer_unroll_loops": True},
    # fewer kernels: fusions without a "hero" (reduce / transpose) through Triton, every fusion through Triton,
    # multi-output fusions of same-shaped roots (this XLA has no softmax/normalization-fusion switch)
    "triton_heroless": {"xla_gpu_experimental_enable_triton_heroless_priority_fusion": True},
    "triton_all": {"xla_gpu_experimental_all_fusions_with_triton": True},
    "multi_output": {
        "xla_gpu_experimental_enable_same_shape_multi_output_fusion": True,
        "xla_gpu_unsupported_enable_triton_multi_output_fusion": True,
    },
}


def _loop(model, n: int, options: dict):
    """The decode loop of `common.decode_loop`, jitted with `options`; also returns the lowered callable."""
    leaves, rebuild = flat_module(model)

    def steps(leaves, tok, cache):
        m = rebuild(leaves)

        def body(_, carry):
            logits, cache = m.decode_step(*carry)
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

        return jax.lax.fori_loop(0, n, body, (tok, cache))

    return leaves, jax.jit(steps, donate_argnums=2, compiler_options=options or None)


def _row(label, b, context, v, ops, ms, floor, kernels) -> dict:
    return {
        "model": label, "batch": b, "context": context, "options": v, "pallas ops": ops,
        "compiler_options": " ".join(f"{k}={o!r}" for k, o in VARIANTS[v].items()) or "(none)",
        "ms per step": "" if ms is None else f"{ms:.3f}", "floor ms": f"{floor:.3f}",
        "x floor": "" if ms is None else f"{ms / floor:.2f}", "kernels per step": kernels,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["hybrid_small"], help="presets, or kimi / glm5 (e2e's folders)")
    p.add_argument("--hf-dir", type=Path, default=None, help="also a Hugging Face folder (e.g. e2e's Kimi-shaped)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--pallas-ops", nargs="+", default=["none"], help='opt-in kernel sets, "+"-joined; "none"')
    p.add_argument("--no-record", action="store_true")
    add_hf_args(p)
    args = p.parse_args()
    from benchmarks.e2e import HF_MODELS, build_model, decode_floor_bytes, hf_model
    from pallas_kernels import use_pallas

    bw, _ = ceilings()
    rows = []
    names = list(args.models) + ([str(args.hf_dir)] if args.hf_dir else [])
    for name in names:
        if args.hf_dir and name == str(args.hf_dir):
            from checkpoints import from_pretrained

            model, label = from_pretrained(args.hf_dir, dtype=jnp.bfloat16, progress=False), "kimi (hf folder)"
        elif name in HF_MODELS:
            model, label = hf_model(args, name), name
        else:
            model, label = build_model(name), name
        cfg = model.config
        page = cfg.page_size
        prefill = jit_module(lambda m, ids, c: m.prefill(ids, c, last_only=True), model, donate_argnums=1)
        for b in args.batches:
            ids = jax.random.randint(jax.random.key(b), (b, args.context), 0, cfg.vocab_size - 8, jnp.int32)
            runs = len(args.variants) * len(args.pallas_ops)
            total = args.context + args.steps * (args.reps + 2) * runs + 8
            cache = model.init_cache(b, -(-total // page) * page)
            logits, cache = prefill(ids, cache)
            floor = decode_floor_bytes(model, cache, b, args.context) / bw * 1e3
            tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            for v, ops in ((v, ops) for v in args.variants for ops in args.pallas_ops):
                leaves, loop = _loop(model, args.steps, VARIANTS[v])  # a fresh function: traced under `ops`
                switch = contextlib.nullcontext() if ops == "none" else use_pallas(ops=ops.split("+"))
                try:
                    with switch:
                        compiled = loop.lower(leaves, tok, cache).compile()
                except Exception as e:  # noqa: BLE001 — an option this XLA rejects is a row, not a crash
                    print(f"  {label} B={b} {v} {ops}: {type(e).__name__}: {e}"[:300], flush=True)
                    rows.append(_row(label, b, args.context, v, ops, None, floor, "rejected"))
                    continue
                kernels = sum(count_kernels(compiled.as_text()).values())
                box = {"tok": tok, "cache": cache}

                def run(box=box, compiled=compiled, leaves=leaves):
                    box["tok"], box["cache"] = compiled(leaves, box["tok"], box["cache"])
                    return box["tok"]

                ms = median_ms(run, warmup=2, iters=args.reps) / args.steps
                tok, cache = box["tok"], box["cache"]
                row = _row(label, b, args.context, v, ops, ms, floor, kernels)
                print("  " + " | ".join(f"{k}={o}" for k, o in row.items()), flush=True)
                rows.append(row)
            del cache, logits
        del model
        jax.clear_caches()
    title = (
        f"Decode step under XLA compiler options ({args.steps} greedy steps per executable, median of "
        f"{args.reps}); floor = bytes over the measured HBM bandwidth {bw / 1e12:.2f} TB/s"
    )
    report("xla_flags.py", title, rows, record=not args.no_record)


if __name__ == "__main__":
    main()
