"""Kernels one decode step launches, counted from the compiled HLO, per stage of a sparse layer and for the
whole model step, with the step's median time. Rows go to benchmarks/results/.

A kernel here is an instruction of the optimized HLO that runs on the device: a fusion, a custom call
(cuBLAS / cuDNN / Triton / Pallas), a copy, sort, scatter, gather or any other non-fused op; parameters,
constants, tuples, bitcasts and get-tuple-element launch nothing; control flow (while, conditional, call)
is counted through its bodies (a loop body once). On a GPU this is the number of launches per step; on a
CPU it counts the same graph's thunks, which is only a proxy.

Each stage is compiled and timed twice: with the indexer's prolog step by step (XLA's kernels) and through
the fused prolog kernel (`indexer_prolog`, opt-in); times are per call of CHAIN chained
calls in one executable (`carried_ms`: no host dispatch), the pool / state / cache each stage writes in place
carried from call to call and donated, as in generate's loop (before 2026-11-30 it was a constant of the chain,
so XLA copied it ahead of every in-place kernel: the whole-step rows of earlier tables count those copies).

Stages of the sparse layer (what the issue calls the decode prolog and the rest):
    indexer prolog — the indexer's projections, key norm, RoPE, quantization and the key-pool write;
    indexer top-k  — scores and selection (given the prolog's outputs);
    sparse layer   — the whole mixer of one sparse layer (prolog + top-k + MLA projections + sparse MLA).

    python -m benchmarks.kernel_count [--model hybrid_small] [--batch 16] [--context 2048] [--no-record]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import re

import jax
import jax.numpy as jnp

from benchmarks.common import CHAIN, median_ms, report
from benchmarks.e2e_stages import _info
from pallas_kernels import use_pallas

_NO_KERNEL = {
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "partition-id", "replica-id",
    "opt-barrier", "add-dependency",
}  # fmt: skip
_CONTROL = {"while", "conditional", "call"}


def count_kernels(compiled_text: str) -> collections.Counter:
    """Kernel-launching instructions of the entry computation, recursing into while/conditional/call bodies
    (fusion bodies are one kernel each and are not entered)."""
    comps: dict[str, list[str]] = {}
    name, entry = None, None
    for line in compiled_text.splitlines():
        header = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if header and not line.startswith(" "):
            name = header.group(2)
            comps[name] = []
            if header.group(1):
                entry = name
            continue
        if name is not None and line.startswith(" ") and "=" in line:
            comps[name].append(line.strip())
    kinds: collections.Counter = collections.Counter()

    def walk(comp: str, seen: tuple) -> None:
        for ins in comps.get(comp, []):
            m = re.match(r"(?:ROOT\s+)?%?[\w.\-]+\s*=\s*\S+\s+([\w\-]+)\(", ins)
            if m is None:
                m = re.match(r"(?:ROOT\s+)?%?[\w.\-]+\s*=\s*\([^)]*\)\s+([\w\-]+)\(", ins)  # tuple-shaped results
            if m is None:
                continue
            op = m.group(1)
            if op in _NO_KERNEL:
                continue
            if op in _CONTROL:
                for callee in re.findall(r"(?:body|condition|to_apply|branch_computations|true_computation|"
                                         r"false_computation)=\{?%?([\w.\-]+)", ins):  # fmt: skip
                    if callee not in seen:
                        walk(callee, (*seen, callee))
                continue
            if op == "fusion":
                kind = re.search(r"kind=(\w+)", ins)
                op = f"fusion ({kind.group(1)})" if kind else "fusion"
                if "__triton" in ins or "custom_call_target" in ins:
                    op = "fusion (triton / custom)"
            elif op == "custom-call":
                target = re.search(r'custom_call_target="([^"]+)"', ins)
                op = f"custom-call {target.group(1) if target else ''}".strip()
            kinds[op] += 1

    walk(entry, (entry,))
    return kinds


def carried_ms(fn, args, updated, n: int = CHAIN) -> tuple[float, object]:
    """Median ms per call of fn(*args) run n times in one executable, each call's first argument made to depend
    on the previous call's output (as `common.chained_ms`) and its last argument — the pool, state or cache it
    updates in place — replaced by `updated(output)` and donated. Returns (ms, the last updated state): the
    one passed in is consumed."""

    def chain(first, *rest):
        *const, state = rest
        for _ in range(n):
            out = fn(first, *const, state)
            leaf = jax.tree.leaves(out)[0].ravel()[0]
            first = first + (leaf == -1234567).astype(first.dtype)
            state = updated(out)
        return first, state

    chained = jax.jit(chain, donate_argnums=(len(args) - 1,))
    box = {"state": args[-1]}

    def call():
        _, box["state"] = chained(*args[:-1], box["state"])
        return box["state"]

    return median_ms(call, warmup=1, iters=10) / n, box["state"]


def rows_for(model, b: int, context: int, label: str) -> list[dict]:
    cfg = model.config
    page = cfg.page_size
    cache = model.init_cache(b, -(-(context + 8) // page) * page)
    i = cfg.layer_types.index("sparse")
    layer = model.layers[i].self_attn
    info = _info(cache, b, 1, context, "decode")
    x = jax.random.normal(jax.random.key(0), (b, 1, cfg.hidden_size), model.dtypes.compute)
    c_q = layer.q_a_layernorm(layer.q_a_proj(x)) if cfg.q_lora_rank is not None else x
    state = cache.layers[i]

    # (fn, args, the argument a call updates in place — the last — and where the call returns it): first
    # argument an array, each call made to depend on the previous one through it; the updated pool, state or
    # cache carried from call to call and donated, as in generate's loop (a constant one would make XLA copy
    # it before every in-place kernel, counting and timing copies generate does not make)
    stages = {
        "indexer prolog": (lambda x, idx, c_q, info, pool: idx.prolog(x, c_q, info, pool),
                           (x, layer.indexer, c_q, info, state.index_k), lambda out: out[2]),
        "indexer (prolog + scores + top-k)": (lambda x, idx, c_q, info, pool: idx(x, c_q, info, pool),
                                              (x, layer.indexer, c_q, info, state.index_k), lambda out: out[1]),
        "sparse layer mixer": (lambda x, m, info, st: m(x, info, st), (x, layer, info, state), lambda out: out[1]),
        "whole model decode step": (lambda ids, m, c: m.decode_step(ids, c), (jnp.zeros((b,), jnp.int32), model,
                                                                                cache), lambda out: out[1]),
    }  # fmt: skip
    # the prolog step by step (XLA's kernels, the default) and as the one fused kernel (`indexer_prolog`)
    versions = {
        "prolog step by step": contextlib.nullcontext,
        "prolog fused": lambda: use_pallas(ops=["indexer_prolog"]),
    }
    out = []
    for version, context_fn in versions.items():
        for name, (fn, args, updated) in stages.items():
            last = len(args) - 1
            with context_fn():  # read at trace time: a fresh function to trace inside (jit caches by function)
                step = jax.jit(lambda *a, fn=fn: fn(*a), donate_argnums=(last,))
                kinds = count_kernels(step.lower(*args).compile().as_text())
                # a copy is donated: the stages and versions share the pools and cache
                ms, _ = carried_ms(fn, (*args[:last], jax.tree.map(jnp.copy, args[last])), updated)
            top = ", ".join(f"{k} {v}" for k, v in kinds.most_common(4))
            out.append({"model": label, "version": version, "stage": name, "batch": b,
                        "kernels": sum(kinds.values()), "ms per call": f"{ms:.3f}", "most common": top})  # fmt: skip
            print("  " + " | ".join(str(v) for v in out[-1].values()), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="hybrid_small")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--quant", action="store_true", help="the hierarchical quant config (MXFP8 indexer, FP8 cache)")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args()
    from benchmarks.e2e import build_model

    model = build_model(args.model, "hierarchical" if args.quant else "none")  # bf16 weights
    label = args.model + (" (hierarchical quant)" if args.quant else "")
    rows = [r for b in args.batch for r in rows_for(model, b, args.context, label)]
    title = (
        f"Kernels per decode step (compiled HLO on {jax.default_backend()}), context {args.context}, "
        f"{CHAIN} chained calls"
    )
    report("kernel_count.py", title, rows, record=not args.no_record)


if __name__ == "__main__":
    main()
