"""Speculative decoding: decode tokens/s of `generate(draft=...)` against plain `generate` in the same process,
and one verify step (k + 1 tokens through the caches, then `commit`) against one decode step.

The model is a preset cut to --layers / --experts with random bf16 weights (default: Kimi-Linear-48B's widths,
8 layers, 32 experts). Random weights do not continue a text the way a trained model does, so what the n-gram
drafter gets accepted on them says nothing about a real checkpoint; the table therefore also runs a replay
drafter (`hybrid_jax.speculative.replay_drafter`) that proposes plain greedy's output, as is or with every n-th
token wrong. That is a known acceptance only while the speculative run follows plain greedy: in bf16 the block's
rounding differs from a decode step's and random weights' logits nearly tie (and a near-tied router flips an
expert), so the runs part within a few tokens (the "same tokens" note says whether they did; `--dtype float32
--precision highest` keeps them together). `--own-replay RUNS` replays the speculative run's own greedy output
instead (`own_replay`: a fixed point, found in RUNS runs at most), so that every draft is the target's own
choice, or every n-th one wrong; it replaces the replay of plain greedy. Its drafts cost nothing to make: those
rows measure the verify loop at a chosen acceptance, not a drafter. The tokens per verify step (the accepted
drafts and the target's own token after them) are always measured, never assumed.

With --mtp the model carries one multi-token-prediction module (random weights, the preset's sparse or dense
MLA layer + MoE), and the table adds `draft="mtp"` and the cost of one MTP drafting call (k drafts) beside a
decode step: with random weights its drafts are rarely accepted, so that row measures the drafting overhead a
trained module's acceptance has to repay, not a speedup.

"vs plain at byte floors" is each speculative row's speedup if the verify and decode steps both ran at their
byte floors (or at the same fraction of them), drafting free: its tokens per verify step over the verify
step's byte floor in decode steps' (`e2e.decode_floor_bytes` with k + 1 tokens a row, whose tokens choose more
distinct experts than one token under uniform routing; the verify row's note gives that ratio). At B = 1 both
steps are bound by the weights they read; a row beats this figure only with a verify step nearer its floor
than the decode step is to its own.

The prompt is repetitive (a 64-token pattern repeated: code-like). Decode time = a generate call's time minus
that of a generate call making one token (the same prefill), medians of --reps calls after a compile.

    python -m benchmarks.speculative [--preset kimi_linear_48b] [--layers 8] [--experts 32] [--batches 1 16]
        [--context 2048] [--new 256] [--num-draft 4] [--wrong-every 3] [--own-replay RUNS] [--dtype bfloat16]
        [--precision highest] [--mtp] [--no-record]
    python -m benchmarks.speculative --floors [--layers 99 --experts 999]   # the floors only, counted on the CPU
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.common import jit_module, median_ms, report
from benchmarks.e2e import decode_floor_bytes
from benchmarks.gpu_parity import cut_config
from hybrid_jax import PRESETS, HybridLM, generate
from hybrid_jax.speculative import mtp_draft, replay_drafter


def repetitive_prompt(batch: int, length: int, vocab: int, seed: int = 0) -> jax.Array:
    """[batch, length] int32: a random 64-token pattern per row, repeated."""
    pattern = jax.random.randint(jax.random.key(seed), (batch, 64), 0, vocab - 8, jnp.int32)
    return jnp.tile(pattern, (1, -(-length // 64)))[:, :length]


def step_ms(fn, cache, args, steps: int) -> float:
    """Median ms of `cache = fn(cache, *args)` called `steps` times, each a separate dispatch on the cache the
    previous call returned (nothing to hoist across calls), after one compile call."""
    cache = fn(cache, *args)
    jax.block_until_ready(cache)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        cache = fn(cache, *args)
        jax.block_until_ready(cache)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def own_replay(model, ids, reference, new: int, k: int, wrong_every, max_runs: int, reps: int):
    """Speculative decode replaying the speculative run's own greedy output: a fixed point of
    D -> ids ++ generate(draft=replay_drafter(D, wrong_every)).tokens, starting from `reference` (plain greedy).

    In bf16 a verify block ranks near-tied tokens differently from a decode step, so a replay of plain greedy is
    rejected where the two part and replays the wrong continuation from there on. Each run agrees with the last
    up to the first position where their drafts part, and there the new run's token is the one its own block
    computes, which the next run (same blocks up to there) accepts: the agreement grows by at least one token a
    run, so a fixed point comes within `new` runs, every draft the target's own choice except the every-n-th
    wrong ones. This assumes a block's logits at a position do not depend on the tokens after it in the block
    (causal layers; the MoE's rows computed alike whatever the other rows route to) and that runs are
    deterministic (d92094e made the MoE reference so). The drafts cost nothing to make: the rows measure the
    verify loop at a chosen acceptance, not a drafter.
    -> (median ms of generate on the drafts of the last run made, that run's output, runs made, whether it
    replayed its own drafts). The timed calls must reproduce that output (a SystemExit otherwise)."""
    fn = jax.jit(lambda m, i, ref: generate(m, i, max_new_tokens=new, draft=replay_drafter(ref, wrong_every),
                                            num_draft=k))  # fmt: skip
    ref, runs = jnp.asarray(reference, jnp.int32), 0
    while True:
        out = fn(model, ids, ref)
        runs += 1
        nxt = jnp.concatenate([ids, out.tokens], axis=1)
        fixed = bool(jnp.array_equal(nxt, ref))
        if fixed or runs >= max_runs:
            break
        ref = nxt
    timed = []
    ms = median_ms(lambda: timed.append(fn(model, ids, ref)) or timed[-1], warmup=0, iters=reps)
    if any(not np.array_equal(np.asarray(t.tokens), np.asarray(out.tokens)) for t in timed):
        raise SystemExit("speculative: a timed own-replay call emitted other tokens than the run it times")
    return ms, out, runs, fixed


def measure(model, batch: int, args, emit) -> None:
    cfg = model.config
    k, new, ctx = args.num_draft, args.new, args.context
    ids = repetitive_prompt(batch, ctx, cfg.vocab_size)
    gen = jax.jit(generate, static_argnames=("max_new_tokens", "draft", "num_draft"))
    base = dict(batch=batch, context=ctx, new=new)

    def timed(**kw):
        out = gen(model, ids, **kw)
        jax.block_until_ready(out)
        return median_ms(lambda: gen(model, ids, **kw), warmup=0, iters=args.reps), out

    # The byte floors of a verify step (k + 1 tokens a row) and of a decode step: at B = 1 both steps are bound by
    # the bytes they read, mostly weights, and a block's tokens route to more experts than one token does, so
    # tokens per step x decode floor / verify floor is the speedup with both steps equally near their floors.
    # (counted on the cache's shapes: nothing is allocated for it)
    floor_cache = jax.eval_shape(lambda: model.init_cache(batch, -(-(ctx + k + 1) // cfg.page_size) * cfg.page_size))
    floor_ratio = decode_floor_bytes(model, floor_cache, batch, ctx, k + 1) / decode_floor_bytes(
        model, floor_cache, batch, ctx
    )
    prefill_ms, _ = timed(max_new_tokens=1)
    plain_ms, plain = timed(max_new_tokens=new)
    decode_ms = plain_ms - prefill_ms
    tokens = batch * (new - 1)
    emit(dict(base, case="plain greedy", drafter="", ms=decode_ms, tok_s=tokens / decode_ms * 1e3, speedup=1.0))
    reference = np.concatenate([np.asarray(ids), np.asarray(plain.tokens)], axis=1)
    drafters = {"ngram": "ngram"}
    if not args.own_replay:  # the own replay starts from this one and is it where verify and decode agree
        drafters["replay of plain greedy"] = replay_drafter(reference)
        drafters.update(
            {f"replay of plain greedy, every {n}-th wrong": replay_drafter(reference, n) for n in args.wrong_every}
        )
    if cfg.mtp_layers:
        drafters["mtp (random weights)"] = "mtp"

    def row(label, ms, out, note="", own=False):
        same = bool(np.array_equal(np.asarray(out.tokens), np.asarray(plain.tokens)))
        steps = np.asarray(out.drafted).sum() / k
        # tokens emitted per verify step and row: the accepted drafts and the target's own token after them
        per_step = (np.asarray(out.lengths).sum() - batch) / steps
        if own:  # its own greedy by construction: plain greedy's only where blocks and decode steps agree
            note = ("plain greedy's tokens" if same else "own greedy, not plain greedy's") + note
        else:
            note = ("same tokens as plain greedy" if same else "TOKENS DIFFER from plain greedy") + note
        emit(dict(base, case=f"speculative k={k}", drafter=label, ms=ms, tok_s=tokens / ms * 1e3,
                  speedup=decode_ms / ms, per_step=per_step, at_floors=per_step / floor_ratio, note=note))  # fmt: skip

    for label, draft in drafters.items():
        ms, out = timed(max_new_tokens=new, draft=draft, num_draft=k)
        # the MTP drafter's prefill also runs the module over the prompt: subtract that prefill
        ms -= timed(max_new_tokens=1, draft=draft, num_draft=k)[0] if draft == "mtp" else prefill_ms
        row(label, ms, out)
    for n in [None, *args.wrong_every] if args.own_replay else []:
        ms, out, iters, fixed = own_replay(model, ids, reference, new, k, n, args.own_replay, args.reps)
        label = "replay of its own greedy" + (f", every {n}-th wrong" if n else "")
        note = f"; {'fixed point' if fixed else 'NO fixed point'} after {iters} runs"
        row(label, ms - prefill_ms, out, note, own=True)

    # one verify step (k + 1 tokens, keep 1) against one decode step, each its own dispatch
    page = cfg.page_size
    cache = model.init_cache(batch, -(-(ctx + 4 * (args.steps + 2) * (k + 1)) // page) * page)
    cache = jit_module(lambda m, i, c: m.prefill(i, c)[1], model)(ids, cache)
    decode = jit_module(lambda m, c, t: m.decode_step(t, c)[1], model, donate_argnums=0)
    block = ids[:, -(k + 1) :]  # k + 1 different prompt tokens: they route to as many experts as a real block
    keep = jnp.ones((batch,), jnp.int32)
    verify = jit_module(lambda m, c, b, n: m.commit(m.verify(b, c)[1], n), model, donate_argnums=0)
    d_ms = step_ms(decode, jax.tree.map(jnp.copy, cache), (ids[:, 0],), args.steps)
    v_ms = step_ms(verify, cache, (block, keep), args.steps)
    emit(dict(base, case="decode step", drafter="", ms=d_ms, note="one dispatch a call"))
    emit(dict(base, case=f"verify step, {k + 1} tokens + commit", drafter="", ms=v_ms,
              note=f"{v_ms / d_ms:.2f}x a decode step; byte floor {floor_ratio:.2f}x a decode step's"))  # fmt: skip
    if cfg.mtp_layers:  # one drafting call: a pending row, then k - 1 one-row steps and the rollback
        mcache = model.init_mtp_cache(batch, cache.max_len)
        hidden = jnp.zeros((batch, ctx, cfg.hidden_size), model.dtypes.compute)
        fill = jit_module(lambda m, c, i, h: m.mtp_extend(i, h, c, jnp.full((batch,), ctx), last_only=True)[2], model)
        mcache = fill(mcache, ids, hidden)
        pend_ids, pend_h = ids[:, : k + 1], jnp.ones((batch, k + 1, cfg.hidden_size), model.dtypes.compute)
        one = jnp.ones((batch,), jnp.int32)

        def draft_call(m, c, i, h):  # the rollback puts the cache back at ctx + 1 rows: trim to ctx for the next
            c = mtp_draft(m, c, i, h, one, k)[2]
            return c.replace(lengths=c.lengths - 1)

        draft_fn = jit_module(draft_call, model, donate_argnums=0)
        m_ms = step_ms(draft_fn, mcache, (pend_ids, pend_h), args.steps)
        emit(dict(base, case=f"mtp drafting call, {k} drafts", drafter="", ms=m_ms,
                  note=f"{m_ms / d_ms:.2f}x a decode step"))  # fmt: skip


def floor_table(cfg, dtype, batches, context: int, k: int) -> list[dict]:
    """The verify step's byte floor in decode steps' for blocks of 2 .. k + 1 tokens a row, at each batch size,
    and the speedup with both steps at their floors when every draft is accepted (a block's tokens a step).
    Counted on an abstract model and cache (`nnx.eval_shape`): no weights are made, so full-size presets take
    a second."""
    model = nnx.eval_shape(lambda: HybridLM(cfg, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0)))
    rows = []
    for b in batches:
        cache = jax.eval_shape(lambda b=b: model.init_cache(b, -(-(context + k + 1) // cfg.page_size) * cfg.page_size))
        one = decode_floor_bytes(model, cache, b, context)
        for t in range(2, k + 2):
            ratio = decode_floor_bytes(model, cache, b, context, t) / one
            rows.append(
                {
                    "batch": b,
                    "context": context,
                    "tokens a row": t,
                    "decode step floor MB": f"{one / 1e6:,.0f}",
                    "verify / decode floor": f"{ratio:.2f}",
                    "speedup at the floors, every draft accepted": f"{t / ratio:.2f}",
                }
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="kimi_linear_48b", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--num-draft", type=int, default=4)
    p.add_argument("--wrong-every", type=int, nargs="*", default=[3])
    p.add_argument(
        "--own-replay", type=int, default=0, metavar="RUNS",
        help="also replay the speculative run's own greedy output (a fixed point found in at most RUNS runs)",
    )  # fmt: skip
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument(
        "--precision", default=None, choices=["default", "high", "highest"],
        help="jax_default_matmul_precision (float32 runs: 'highest' keeps verify and decode logits within ~1e-6)",
    )  # fmt: skip
    p.add_argument("--mtp", action="store_true", help="give the model one random MTP module and time draft='mtp'")
    p.add_argument("--no-record", action="store_true")
    p.add_argument(
        "--floors", action="store_true",
        help="print the verify step's byte floor against a decode step's for blocks of 2 .. k + 1 tokens (counted, "
        "nothing run or recorded; pass --layers / --experts past the preset's for the full model)",
    )  # fmt: skip
    args = p.parse_args()
    for name, v in (("--new", args.new), ("--num-draft", args.num_draft), ("--context", args.context)):
        if v < (2 if name == "--new" else 1):
            raise SystemExit(f"speculative: {name}={v} is too small")
    if args.precision is not None:
        jax.config.update("jax_default_matmul_precision", args.precision)
    cfg = cut_config(PRESETS[args.preset](), args.layers, args.experts)
    if args.mtp:
        mixer = "sparse" if "sparse" in cfg.layer_types else "full"
        if cfg.hc_mult is not None:
            raise SystemExit(f"speculative: --mtp takes plain residuals; {args.preset} has hyper-connections")
        cfg = cfg.replace(  # an MTP module takes plain residuals: AttnRes (if any) is dropped, as the title says
            mtp_layers=1, mtp_layer_type=mixer, mtp_mlp_type="moe" if cfg.num_experts else "dense",
            attn_res_block_size=None,
        )  # fmt: skip
    dtype = jnp.dtype(args.dtype)
    if args.floors:
        title = (f"Speculative decoding, byte floors ({args.preset} widths, {cfg.num_layers} layers, "
                 f"{cfg.num_experts} experts, {args.dtype}; uniform routing; counted, not measured)")  # fmt: skip
        report(
            "speculative.py", title, floor_table(cfg, dtype, args.batches, args.context, args.num_draft), record=False
        )
        return
    model = HybridLM(cfg, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
    rows = []

    def emit(row):
        rows.append(row)
        print("  " + " | ".join(f"{k}={v}" for k, v in row.items()), flush=True)

    try:
        for b in args.batches:
            measure(model, b, args, emit)
    except KeyboardInterrupt:
        print("interrupted: reporting the rows measured so far", flush=True)
    shape = f"{args.preset} widths, {cfg.num_layers} layers, {cfg.num_experts} experts, random {args.dtype} weights"
    if args.precision is not None:
        shape += f", {args.precision} matmul precision"
    if args.mtp:
        shape += f", one random {cfg.mtp_layer_type} MLA + {cfg.mtp_mlp_type} MTP module, no AttnRes"
    title = f"Speculative decoding ({shape}); repetitive prompt, {args.new} new tokens"
    columns = ("batch", "context", "case", "drafter", "per_step", "ms", "tok_s", "speedup", "at_floors", "note")
    names = {"per_step": "tokens per verify step", "tok_s": "tokens/s", "speedup": "vs plain",
             "at_floors": "vs plain at byte floors"}  # fmt: skip
    table = [{names.get(c, c): _fmt(r.get(c)) for c in columns} for r in rows]
    report("speculative.py", title, table, record=not args.no_record)


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:,.0f}" if v >= 1000 else f"{v:.2f}"
    return str(v)


if __name__ == "__main__":
    main()
