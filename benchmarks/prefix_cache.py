"""Prefix caching: time to first token of a long shared prefix + new tokens with a warm `PrefixCache` against no
cache, what storing the prefix (prefill calls that keep the states at every block end) costs against a plain
prefill, and the memory the cache holds per cached token. One process, identical prompts.

The model is a preset cut to --layers / --experts with random bf16 weights (default: Kimi-Linear-48B's widths,
8 layers, 32 experts). B = 1; the prompt is --prefix shared tokens + --new fresh ones. TTFT = one jitted
`generate(max_new_tokens=1)` call, median of --reps after a compile:
- "no cache, one shot": generate(prefill_chunk=prompt length): the whole prompt in one call (the baseline);
- "no cache": plain generate (one-shot prefill up to `default_prefill_chunk`, chunks of it beyond);
- "no cache, block chunks": generate(prefill_chunk=block_size), the chunking alone, no snapshots;
- "cold cache (storing)": an empty PrefixCache (a fresh one each call), its default calls (`PrefixCache.default_chunk`
  tokens, each keeping the states at every block end inside it, then block and tail calls): the cost of filling
  the cache;
- "cold cache (storing), one call": the same with prefill_chunk = the prompt's whole blocks: its blocks in one call
  (snapshots at every block end), the partial last block in a tail call — against the one-shot baseline;
- "prefix in one prefill call[, snapshots every <block>]": `model.prefill` of the prefix alone, without and with
  `snapshot_every=block`: what returning the states costs;
- "warm cache": the prefix stored by an earlier call: only the blocks past it are prefilled.

    python -m benchmarks.prefix_cache [--preset kimi_linear_48b] [--layers 8] [--experts 32] [--prefix 32768]
        [--new 512] [--block-sizes 2048] [--reps 5] [--no-record]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.common import report
from benchmarks.gpu_parity import cut_config
from hybrid_jax import PRESETS, HybridLM, PrefixCache, generate
from hybrid_jax.cache import KDAState

STATIC = ("max_new_tokens", "prefill_chunk")


def timed(call, reps: int) -> float:
    """Median ms of `call()` (each call its own dispatch on fresh inputs; one untimed compile call first)."""
    jax.block_until_ready(call())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bytes_per_token(pc: PrefixCache) -> tuple[float, float]:
    """(pool bytes, snapshot bytes) the cache holds per token of its capacity."""
    snaps = sum(x.nbytes for st in pc.store if isinstance(st, KDAState) for x in (st.conv, st.recurrent))
    snaps += sum(st.index_tail.nbytes for st in pc.store if not isinstance(st, KDAState) and st.index_tail is not None)
    total = sum(x.nbytes for x in jax.tree_util.tree_leaves(pc.store))
    return (total - snaps) / pc.capacity_tokens, snaps / pc.capacity_tokens


def snapshot_rows(model, ids, blk: int, reps: int) -> list[dict]:
    """`model.prefill` of ids in one call with snapshot_every=blk, against the same call without (both jitted,
    fresh caches made outside the timing; the cache donated)."""
    b, t = ids.shape
    plain = jax.jit(lambda m, i, c: m.prefill(i, c, last_only=True), donate_argnums=2)
    snap = jax.jit(lambda m, i, c: m.prefill(i, c, last_only=True, snapshot_every=blk), donate_argnums=2)
    ms = {}
    for name, fn in (("plain", plain), ("snap", snap)):
        caches = [model.init_cache(b, t) for _ in range(reps + 1)]
        jax.block_until_ready(caches)
        jax.block_until_ready(fn(model, ids, caches[0]))  # compile
        times = []
        for c in caches[1:]:
            t0 = time.perf_counter()
            jax.block_until_ready(fn(model, ids, c))
            times.append((time.perf_counter() - t0) * 1e3)
        ms[name] = statistics.median(times)
    # "vs one shot" is left empty: these prefill the prefix alone, not the whole prompt
    return [
        dict(case="prefix in one prefill call", block=blk, ms=ms["plain"], vs=None, note=f"{t} tokens"),
        dict(
            case=f"prefix in one prefill call, snapshots every {blk}", block=blk, ms=ms["snap"], vs=None,
            note=f"{ms['snap'] / ms['plain']:.3f}x the call without snapshots",
        ),
    ]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="kimi_linear_48b", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--prefix", type=int, default=32768)
    p.add_argument("--new", type=int, default=512)
    p.add_argument("--block-sizes", type=int, nargs="+", default=[2048])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args()
    for name, v in (("--prefix", args.prefix), ("--new", args.new), ("--reps", args.reps)):
        if v < 1:
            raise SystemExit(f"prefix_cache: {name}={v} must be positive")
    cfg = cut_config(PRESETS[args.preset](), args.layers, args.experts)
    model = HybridLM(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    t = args.prefix + args.new
    ids = jax.random.randint(jax.random.key(0), (1, t), 0, cfg.vocab_size, jnp.int32)
    gen = jax.jit(generate, static_argnames=STATIC, donate_argnames=("prefix_cache",))
    rows = []

    def emit(row):
        rows.append(row)
        print("  " + " | ".join(f"{k}={v}" for k, v in row.items()), flush=True)

    try:
        base_ms = timed(lambda: gen(model, ids, max_new_tokens=1, prefill_chunk=t).tokens, args.reps)
        emit(dict(case="no cache, one shot", block="", ms=base_ms, vs=1.0))
        ms = timed(lambda: gen(model, ids, max_new_tokens=1).tokens, args.reps)
        emit(dict(case="no cache", block="", ms=ms, vs=ms / base_ms))
        for blk in args.block_sizes:
            capacity = (2 * -(-t // blk) + 1) * blk  # the running sequence + the stored prefix
            ms = timed(lambda blk=blk: gen(model, ids, max_new_tokens=1, prefill_chunk=blk).tokens, args.reps)
            emit(dict(case="no cache, block chunks", block=blk, ms=ms, vs=ms / base_ms))

            def cold(blk=blk, capacity=capacity, chunk=None):
                pc = PrefixCache(model, max_tokens=capacity, block_size=blk)
                jax.block_until_ready(pc.store)  # allocating the cache is not filling it
                t0 = time.perf_counter()
                out = gen(model, ids, max_new_tokens=1, prefix_cache=pc, prefill_chunk=chunk)
                jax.block_until_ready(out.tokens)
                return (time.perf_counter() - t0) * 1e3, out

            whole = t // blk * blk
            storing = [(None, "cold cache (storing)")]
            if whole >= 2 * blk:  # one call of two blocks or more (else it is the block calls)
                storing.append((whole, "cold cache (storing), one call"))
            for chunk, case in storing:
                cold(chunk=chunk)  # compile
                runs = [cold(chunk=chunk) for _ in range(args.reps)]
                ms = statistics.median(r[0] for r in runs)
                note = "" if chunk is None else f"{whole} tokens in one call + {t - whole} in tail calls"
                emit(dict(case=case, block=blk, ms=ms, vs=ms / base_ms, note=note))
            state = {"pc": runs[-1][1].prefix_cache}
            for row in snapshot_rows(model, ids[:, : args.prefix], blk, args.reps):
                emit(row)

            def warm(state=state):
                out = gen(model, ids, max_new_tokens=1, prefix_cache=state["pc"])
                state["pc"] = out.prefix_cache
                return out.tokens

            ms = timed(warm, args.reps)
            stats = state["pc"].stats()
            hit = stats["hit_tokens"] // (args.reps + 1)  # the same prompt every call
            pool, snap = bytes_per_token(state["pc"])
            emit(
                dict(
                    case="warm cache", block=blk, ms=ms, vs=ms / base_ms,
                    note=f"{hit} of {t} hit; {(pool + snap) / 1024:.1f} KiB/token "
                    f"({pool / 1024:.1f} pages + {snap / 1024:.1f} snapshots)",
                )
            )  # fmt: skip
    except KeyboardInterrupt:
        print("interrupted: reporting the rows measured so far", flush=True)
    title = (
        f"Prefix caching ({args.preset} widths, {cfg.num_layers} layers, {cfg.num_experts} experts, bf16); "
        f"B=1, {args.prefix} shared + {args.new} new tokens, TTFT"
    )
    names = {"vs": "vs one shot"}

    def cell(r, c):
        if c == "vs":
            return "" if r[c] is None else f"{r[c]:.3f}x"
        return f"{r[c]:.1f}" if c == "ms" else str(r.get(c, ""))

    table = [{names.get(c, c): cell(r, c) for c in ("case", "block", "ms", "vs", "note")} for r in rows]
    report("prefix_cache.py", title, table, record=not args.no_record)


if __name__ == "__main__":
    main()
