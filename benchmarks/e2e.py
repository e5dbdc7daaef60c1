"""End-to-end on one GPU: time to first token, decode step, peak memory, start-up; against transformers + fla
and against floors counted from the model. One run prints one table; its rows go to
benchmarks/results/e2e.jsonl.

Models: any preset with random weights (`hybrid_small`: 3 KDA : 1 sparse MLA, MoE, AttnRes), and the ones
transformers builds: `kimi` — a Kimi-Linear-shaped `KimiLinearForCausalLM` (the 48B model's widths,
`--kimi-layers` layers, `--kimi-experts` experts) —, `glm5` — a GLM-5.3-Flash-shaped `glm5_next` model
(full widths, `--glm5-layers` / `--glm5-experts`) — and `qwen3_next` — a Qwen3-Next-80B-A3B-shaped model
(`--qwen3_next-layers` / `--qwen3_next-experts`). `benchmarks/e2e_transformers.py` builds each with random
weights and saves it as a Hugging Face folder once; this engine loads that folder with `from_pretrained` and
transformers loads the same folder in its own process (the baseline; it uses fla's KDA kernels when the `fla`
package imports). This engine's bf16 first-token logits on a 64-token prompt are compared with transformers'
float32 logits from the same bf16-rounded weights (the row "parity").

- TTFT: one jitted call = cache allocation + prefill (last position only) + argmax, batch 1.
- Decode: after a `--context`-token prefill of each batch, (i) 16 greedy `decode_step`s in one executable
  (`lax.fori_loop`, cache donated: the loop `generate` compiles), time per step; (ii) the jitted
  `decode_step` called once per step from Python (host dispatch included; the model's arrays passed as a
  flat list, `common.jit_module`). The table says how many XLA compilations happened during the timed calls
  (should be 0).
- Floors: decode = bytes one step must move (weights read — routed experts scaled by the share a batch
  touches: at B > 1 the distinct experts counted over the 16 decode steps after the timed ones, the note's
  "experts a layer" beside what uniform routing would touch — plus recurrent states read and written and cache
  rows read) over the measured HBM bandwidth; prefill = counted FLOPs (2 x active matmul parameters per token
  plus attention) over the measured bf16 matmul rate (or the weight bytes over bandwidth, if larger).
- Peak memory of each row's call, from XLA's accounting: the device bytes live before the call (weights,
  cache, inputs) plus the compiled executable's temporaries and its outputs that do not alias a donated
  input (`_row_peak_gib`). The device's process-wide peak only grows over a run (the ceiling measurement
  alone takes 8 GiB), so it says nothing about rows after the largest one.
- Start-up: `python -m hybrid_jax generate` in a fresh process, to the first generated token, with an empty
  persistent compilation cache and again with the cache it filled.

    python -m benchmarks.e2e [--models hybrid_small kimi glm5 qwen3_next] [--quant none hierarchical]
        [--ttft 4096 32768 131072] [--batches 1 16 64] [--context 2048] [--no-baseline] [--no-startup] [--no-record]
    python -m benchmarks.e2e --models --no-baseline     # the start-up rows alone
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = 64


def _torch_side(python: str, cmd: list[str], timeout: float) -> tuple[list[dict], str]:
    """Run benchmarks.e2e_transformers in its own process; RESULT lines parsed, the rest returned as a log."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.run(
        [python, "-m", "benchmarks.e2e_transformers", *cmd],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    results = [json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    log = (p.stdout + p.stderr)[-3000:]
    if p.returncode:
        print(f"transformers side `{' '.join(cmd[:2])}` failed (rc {p.returncode}):\n{log}", flush=True)
    return results, log


# The models transformers builds (random weights at a released model's widths, fewer layers and experts):
# name -> (the transformers side's --arch, default layers, default experts).
HF_MODELS = {"kimi": ("kimi", 8, 32), "glm5": ("glm5", 8, 32), "qwen3_next": ("qwen3_next", 8, 64)}
# How a run's title names each shape (the recorded tables are keyed by it): the Kimi shape is named in every
# run without another transformers-built model, as it always was.
SHAPE_LABELS = {"kimi": "Kimi-shaped", "glm5": "glm5-shaped", "qwen3_next": "Qwen3-Next-shaped"}


def add_hf_args(p: argparse.ArgumentParser) -> None:
    """The options that say where and how big the transformers-built folders are (Kimi-Linear-shaped `kimi`,
    GLM-5.3-Flash-shaped `glm5`), and which Python makes them."""
    for name, (_, layers, experts) in HF_MODELS.items():
        p.add_argument(f"--{name}-dir", type=Path, default=Path(tempfile.gettempdir()) / f"hybrid_jax_e2e_{name}")
        p.add_argument(f"--{name}-layers", type=int, default=layers)
        p.add_argument(f"--{name}-experts", type=int, default=experts)
        p.add_argument(f"--{name}-vocab", type=int, default=None, help="default: the released model's")
    p.add_argument("--torch-python", default=sys.executable, help="interpreter with torch + transformers (+ fla)")


def hf_dir(args, name: str) -> Path:
    return getattr(args, f"{name}_dir")


def ensure_hf_dir(args, name: str = "kimi") -> None:
    """The Hugging Face folder of `name` (a key of HF_MODELS), made by the transformers side when missing
    (layers, experts and vocabulary from `args`)."""
    folder = hf_dir(args, name)
    if folder.is_dir():
        return
    make = ["make", str(folder), "--arch", HF_MODELS[name][0], "--layers", str(getattr(args, f"{name}_layers")),
            "--experts", str(getattr(args, f"{name}_experts"))]  # fmt: skip
    vocab = getattr(args, f"{name}_vocab")
    make += (["--vocab", str(vocab)] if vocab else []) + (["--tiny"] if getattr(args, "tiny", False) else [])
    _, log = _torch_side(args.torch_python, make, timeout=900)
    print(log.strip().splitlines()[-1] if log.strip() else "", flush=True)


def hf_model(args, name: str = "kimi", quant_name: str = "none"):
    """The folder of `name` (a key of HF_MODELS; made by the transformers side when missing), loaded in bf16."""
    ensure_hf_dir(args, name)
    return build_model(name, quant_name, hf_dir=hf_dir(args, name))


def _row_peak_gib(fn, *args) -> float | None:
    """Peak device memory of one call of `fn` (a `common.jit_module` function, already compiled for these
    arguments): the bytes live now plus the executable's temporaries and its outputs that do not alias a
    donated input. None where the device keeps no memory statistics (CPU)."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_in_use" not in stats:
        return None
    mem = fn.lower(*args).compile().memory_analysis()
    if mem is None:
        return None
    extra = mem.temp_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
    return (stats["bytes_in_use"] + extra) / 2**30


# ---------------------------------------------------------------- floors counted from the model


def _nbytes(x) -> int:
    """Bytes of an array or of a ShapeDtypeStruct (the floors also count abstract models and caches)."""
    return x.size * x.dtype.itemsize


def _param_bytes(model):
    """(bytes of the weights every step reads, [(routed-expert bytes, experts) per MoE layer],
    matmul parameters a token uses outside the routed experts, [(routed params, experts) per layer])."""
    from flax import nnx

    fixed_bytes, routed, dense_params, routed_params = 0, {}, 0, {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        x = var.get_value()  # an array, or a ShapeDtypeStruct of an abstract model (`nnx.eval_shape`)
        nbytes = _nbytes(x)
        names = [str(p) for p in path]
        if names[0] == "embed_tokens":
            continue  # a step reads B rows of the table, not the table
        if names[0] == "mtp":
            continue  # the drafter's modules: a decode step or a prefill never runs them
        if "experts" in names and "shared_experts" not in names:
            key = names[1]
            b, p = routed.get(key, (0, 0)), routed_params.get(key, (0, 0))
            routed[key] = (b[0] + nbytes, x.shape[0])
            routed_params[key] = (p[0] + x.size, x.shape[0])
            continue
        fixed_bytes += nbytes
        if x.ndim >= 2 and names[0] != "lm_head":
            dense_params += x.size
    order = sorted(routed, key=int)  # keys are layer indices: layer order
    return fixed_bytes, [routed[k] for k in order], dense_params, [routed_params[k] for k in order]


def per_position(pool, page_size: int) -> float:
    """Bytes a paged pool holds per cached position (values + scales; a pool of page_size / k rows a page, as
    the KPool indexer's, holds one row per k positions). 0 for no pool."""
    if pool is None:
        return 0.0
    nbytes = _nbytes(pool.values) + (0 if pool.scales is None else _nbytes(pool.scales))
    return nbytes / (pool.values.shape[0] * page_size)


def decode_floor_bytes(model, cache, batch: int, context: int, tokens: int = 1, touched=None) -> float:
    """Bytes one decode step must move: weights (routed experts: the expected number of distinct experts
    that the step's tokens choose under uniform routing, or `touched`), KDA states read + written, cache rows
    read.

    tokens: positions each of the `batch` rows runs in the step (a speculative verify block: k drafts + 1).
    Its batch x tokens tokens choose the experts; each row's KDA state is still read and written once, and its
    cached rows are read once (the block's positions can share the reads): a sparse layer's top-k rows count
    once, as if the block's positions selected the same rows (the least they can read).
    touched: per MoE layer in layer order, the distinct experts a step's tokens chose (the mean over the steps
    `common.decode_loop(count_experts=True)` counted) instead of the uniform expectation: tokens a router
    sends to the same experts read fewer bytes than it assumes. One token's k experts are k either way."""
    from hybrid_jax.cache import AttnState, KDAState, MLAState

    if batch < 1 or tokens < 1:
        raise ValueError(f"decode_floor_bytes: batch={batch} and tokens={tokens} must be >= 1")
    cfg = model.config
    fixed, routed, _, _ = _param_bytes(model)
    k = cfg.num_experts_per_tok
    if touched is not None and (
        len(touched) != len(routed)
        or any(not 0 < t <= min(e, k * batch * tokens) for t, (_, e) in zip(touched, routed, strict=False))
    ):
        raise ValueError(
            f"decode_floor_bytes: touched={list(touched)} must give 1 to min(experts, {k} x {batch * tokens} tokens) "
            f"experts for each of the {len(routed)} MoE layers"
        )
    total = float(fixed)
    for i, (nbytes, e) in enumerate(routed):
        chosen = e * (1 - (1 - k / e) ** (batch * tokens)) if touched is None else touched[i]
        total += nbytes * chosen / e
    for kind, state in zip(cfg.layer_types, cache.layers, strict=True):
        if isinstance(state, KDAState):
            total += 2 * (_nbytes(state.recurrent) + _nbytes(state.conv))
        elif isinstance(state, AttnState):  # gated GQA: every cached key and value
            total += batch * context * (per_position(state.k, cache.page_size) + per_position(state.v, cache.page_size))
        elif isinstance(state, MLAState):
            row = per_position(state.latent, cache.page_size) + per_position(state.rope, cache.page_size)
            if kind == "sparse":
                # the indexer reads every cached key (a KPool indexer: one pooled key per index_kpool positions,
                # plus its incomplete pool's raw keys); a shared layer reads none
                tail = 0 if state.index_tail is None else _nbytes(state.index_tail)
                total += batch * context * per_position(state.index_k, cache.page_size) + tail
                total += batch * min(cfg.index_topk, context) * row
            else:
                total += batch * context * row
    return total


def count_touched(count_loop, model, batch: int, tok, cache):
    """(tok, cache, touched, note) after `count_loop` (`common.decode_loop(model, n, count_experts=True)`) ran its
    n steps from (tok, cache), donated: touched the mean distinct experts a step's tokens chose per MoE layer
    (`decode_floor_bytes(touched=)`), note what the row says of them. touched is None, and nothing runs, at
    one row (its k experts are k) or with no MoE layer. The steps are the n after the timed ones: the same
    decode run, not the timed steps themselves (those donated their cache), and the note says so.

    A count that fails (out of memory, or the router returned ids outside the experts) leaves the row its
    timings: touched None (the uniform expectation) and a note naming the error; tok and cache are then the
    ones given, unless the loop consumed them (its error is the row's, as any decode failure)."""
    import jax
    import numpy as np

    cfg = model.config
    if batch == 1 or "moe" not in cfg.mlp_types:
        return tok, cache, None, ""
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    try:
        out_tok, out_cache, hits = count_loop(tok, cache)
        hits = np.asarray(hits, np.float64)
    except Exception as err:  # noqa: BLE001 — a count that cannot run costs the floor its count, not the row
        if any(x.is_deleted() for x in jax.tree.leaves(cache) if isinstance(x, jax.Array)):
            raise
        return tok, cache, None, f"experts not counted ({type(err).__name__}): uniform floor"
    if (hits < 0).any():
        bad = int((hits < 0).sum())
        return out_tok, out_cache, None, f"experts not counted (router ids outside 0..{e - 1}, {bad}x): uniform floor"
    touched = [float(x) for x in hits.mean(axis=0)]
    uniform = e * (1 - (1 - k / e) ** batch)
    mean = sum(touched) / len(touched)
    note = f"experts a layer {mean:.1f} of {e} over the next {hits.shape[0]} steps (uniform {uniform:.1f})"
    return out_tok, out_cache, touched, note


def prefill_flops(model, tokens: int) -> float:
    """Counted FLOPs of a batch-1 prefill of `tokens` (last position's logits only): 2 x the matmul
    parameters each token uses (routed experts: k of E) plus attention — KDA chunked form at its chunk size,
    dense MLA causal (expanded heads), sparse layers' indexer (causal, all heads; against one pooled key per
    index_kpool positions; none on a shared layer) and sparse MLA (absorbed, top-k rows), and the lm_head once."""
    cfg = model.config
    _, _, dense, routed = _param_bytes(model)
    per_token = dense + sum(p * cfg.num_experts_per_tok / e for p, e in routed)
    flops = 2.0 * per_token * tokens + 2.0 * cfg.hidden_size * cfg.vocab_size
    pairs = tokens * (tokens + 1) / 2
    for i, kind in enumerate(cfg.layer_types):
        if kind == "linear":
            n, dk, dv, c = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_v_dim, cfg.kda_chunk_size
            # K Kᵀ, Q Kᵀ; the UT solve; W = A K; U = A V and the intra-chunk output A_qk V_new; state products (MACs)
            chunk = 2 * (2 * c * c * dk + c**3 / 3 + c * c * dk + 2 * c * c * dv + 3 * c * dk * dv)
            flops += n * tokens / c * chunk
        elif kind == "full":
            flops += 2 * pairs * cfg.num_heads * (cfg.qk_head_dim + cfg.v_head_dim)
        elif kind == "attention":  # gated GQA: q.k and p.v over H each, every query head
            flops += 2 * pairs * cfg.num_heads * 2 * cfg.attn_head_dim
        else:
            lat, r = cfg.kv_lora_rank, cfg.qk_rope_head_dim
            if not cfg.shares_indexer(i):
                flops += 2 * pairs / cfg.index_kpool * cfg.index_num_heads * cfg.index_head_dim
            rows = min(cfg.index_topk, tokens)
            flops += 2 * tokens * rows * cfg.num_heads * (2 * lat + r)
            flops += 2 * tokens * cfg.num_heads * lat * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return flops


# ---------------------------------------------------------------- this engine


def build_model(name: str, quant_name: str = "none", hf_dir: Path | None = None):
    """A preset with random weights and bf16 parameters (quantized ones where the quant config says so), or
    (name in HF_MODELS) the Hugging Face folder `hf_dir`."""
    import jax.numpy as jnp
    from flax import nnx

    from hybrid_jax import PRESETS, HybridLM
    from hybrid_jax.quant.config import QuantConfig

    quant = QuantConfig.hierarchical() if quant_name == "hierarchical" else None
    if name in HF_MODELS:
        from checkpoints import from_pretrained

        if hf_dir is None:
            raise ValueError(f"build_model({name!r}): a transformers-built model needs its folder (hf_dir)")

        return from_pretrained(hf_dir, dtype=jnp.bfloat16, quant=quant, progress=False)
    cfg = PRESETS[name]()
    param_dtype = None if quant and quant.projection.param_dtype is not None else jnp.bfloat16
    return HybridLM(cfg, dtype=jnp.bfloat16, param_dtype=param_dtype, quant=quant, rngs=nnx.Rngs(0))


def measure_model(name, quant_name, args, bw, rate, emit) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.common import decode_loop, jit_module, median_ms
    from hybrid_jax.compilation import CompileCounter

    t0 = time.perf_counter()
    folder = hf_dir(args, name) if name in HF_MODELS else None
    model = build_model(name, quant_name, folder)
    cfg = model.config
    print(f"[{name}, quant {quant_name}] built/loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    base = dict(model=name, quant=quant_name)
    page = cfg.page_size

    if folder is not None and (folder / "e2e_reference.npz").is_file():
        ref = np.load(folder / "e2e_reference.npz")
        lg = np.asarray(jax.jit(lambda m, i: m(i)[0, -1])(model, jnp.asarray(ref["ids"])), np.float32)
        err = float(np.linalg.norm(lg - ref["logits"]) / np.linalg.norm(ref["logits"]))
        note = f"rel err {err:.1e}, same argmax: {int(lg.argmax()) == int(ref['logits'].argmax())}"
        theirs = f"transformers {ref['dtype']}" if "dtype" in ref else "transformers bf16"  # older folders: bf16
        emit(dict(base, case="parity vs transformers", batch=1, tokens=PROMPT, note=f"{note} (bf16 vs {theirs})"))

    def first_token(m, ids):
        cache = m.init_cache(ids.shape[0], -(-(ids.shape[1] + 1) // page) * page)
        logits, _ = m.prefill(ids, cache, last_only=True)  # [B, vocab]
        return jnp.argmax(logits, axis=-1)

    ttft_fn = jit_module(first_token, model)
    for t in args.ttft:
        if t > cfg.max_position_embeddings:
            continue
        ids = jax.random.randint(jax.random.key(t), (1, t), 0, cfg.vocab_size - 8, jnp.int32)
        long = t >= 65536  # one compile-and-run call, one timed call: a 128K prefill takes seconds
        try:
            ms = median_ms(lambda ids=ids: ttft_fn(ids), warmup=1, iters=1 if long else 3)
        except Exception as e:  # noqa: BLE001 — an OOM is a result of this benchmark, not a crash
            emit(dict(base, case="TTFT", batch=1, tokens=t, note=f"failed: {type(e).__name__}: {str(e)[:150]}"))
            continue
        floor = max(prefill_flops(model, t) / rate, _param_bytes(model)[0] / bw) * 1e3
        peak = _row_peak_gib(ttft_fn, ids)
        emit(dict(base, case="TTFT", batch=1, tokens=t, ms=ms, tok_s=t / ms * 1e3, floor_ms=floor, peak=peak))

    prefill = jit_module(lambda m, ids, c: m.prefill(ids, c, last_only=True), model, donate_argnums=1)
    decode = jit_module(lambda m, ids, c: m.decode_step(ids, c), model, donate_argnums=1)
    loop_n, reps = 16, 5
    loop = decode_loop(model, loop_n)
    count_loop = decode_loop(model, loop_n, count_experts=True) if "moe" in cfg.mlp_types else None
    steps = 20
    for b in args.batches:
        ctx = args.context
        ids = jax.random.randint(jax.random.key(b), (b, ctx), 0, cfg.vocab_size - 8, jnp.int32)
        try:
            # the context goes in pieces of <= 32K tokens over the batch: one 64 x 2048 call would hand
            # XLA's ragged_dot lowering a [B*T*k, E*D] operand (144 GiB at Kimi widths: it ran out of memory)
            cache = model.init_cache(b, -(-(ctx + steps + 2 + loop_n * (reps + 2) + 8) // page) * page)
            piece = max(page, (32768 // b) // page * page)
            for s0 in range(0, ctx, piece):
                logits, cache = prefill(ids[:, s0 : s0 + piece], cache)
            box = {"cache": cache, "tok": jnp.argmax(logits, axis=-1).astype(jnp.int32)}  # logits [B, vocab]

            def step(box=box):
                lg, box["cache"] = decode(box["tok"], box["cache"])
                return lg

            def looped(box=box):
                box["tok"], box["cache"] = loop(box["tok"], box["cache"])
                return box["tok"]

            jax.block_until_ready(step())  # compile
            jax.block_until_ready(step())
            jax.block_until_ready(looped())
            times = []
            with CompileCounter() as cc:
                for _ in range(steps):
                    t0 = time.perf_counter()
                    jax.block_until_ready(step())
                    times.append((time.perf_counter() - t0) * 1e3)
                ms_loop = median_ms(looped, warmup=0, iters=reps) / loop_n
            ms = statistics.median(times)
            loop_note = f"{cc.compiled} compilations in all timed calls"
            peak = _row_peak_gib(loop, box["tok"], box["cache"])  # after the counted calls: it compiles
            box["tok"], box["cache"], touched, experts = count_touched(count_loop, model, b, box["tok"], box["cache"])
            nbytes = decode_floor_bytes(model, box["cache"], b, ctx, touched=touched)
        except Exception as e:  # noqa: BLE001
            emit(
                dict(base, case="decode step", batch=b, tokens=ctx, note=f"failed: {type(e).__name__}: {str(e)[:150]}")
            )
            continue
        emit(
            dict(
                base, case="decode step (in-jit loop, as generate)", batch=b, tokens=ctx, ms=ms_loop,
                tok_s=b / ms_loop * 1e3, floor_ms=nbytes / bw * 1e3, peak=peak,
                note="; ".join(filter(None, [f"{loop_n} steps per executable", loop_note, experts])),
            )
        )  # fmt: skip
        emit(
            dict(
                base, case="decode step (one call per step)", batch=b, tokens=ctx, ms=ms, tok_s=b / ms * 1e3,
                floor_ms=nbytes / bw * 1e3,
                note="; ".join(filter(None, ["host dispatch included", f"{steps} timed steps", experts])),
            )
        )  # fmt: skip
        del box, cache, logits


def measure_startup(config: str, emit) -> None:
    """`python -m hybrid_jax generate` twice in fresh processes sharing a new persistent cache folder."""
    with tempfile.TemporaryDirectory(prefix="hybrid_jax_jit_") as cache_dir:
        for label in ("cold (empty persistent cache)", "warm (persistent cache from the run before)"):
            cmd = [sys.executable, "-m", "hybrid_jax", "generate", "--config", config, "--max-new-tokens", "1",
                   "--compile-cache", cache_dir]  # fmt: skip
            t0 = time.perf_counter()
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
            wall = time.perf_counter() - t0
            out = p.stdout + p.stderr
            comp = next((ln for ln in out.splitlines() if ln.startswith("XLA compilations")), "")
            comp = comp.split(" (persistent cache")[0]
            first = next((ln for ln in out.splitlines() if "first call incl. compilation" in ln), "")
            first_s = first.rsplit("compilation", 1)[-1].strip(" s)") if first else "?"
            note = (
                f"process start to exit {wall:.1f} s (first generate call {first_s} s); {comp}"
                if p.returncode == 0
                else f"failed rc {p.returncode}: {out[-300:]}"
            )
            emit(dict(model=config, quant="none", case=f"start-up, {label}", batch=1, tokens=0,
                      ms=wall * 1e3, note=note))  # fmt: skip


def _fmt(v, spec):
    return "" if v is None else format(v, spec)


def run_title(args, bw: float, rate: float) -> str:
    """The table's title: the models and shapes run, the context, the measured ceilings (`common.split_title`
    keeps the models and ceilings out of the recorded table name)."""
    if not args.models:
        return (
            f"Start-up of `python -m hybrid_jax generate --config {args.startup_config}`, one process each: cold, "
            "then warm from the persistent compilation cache the first filled"
        )
    named = [n for n in HF_MODELS if n in args.models or (n == "kimi" and not set(args.models) & set(HF_MODELS))]
    shapes = "; ".join(
        f"{SHAPE_LABELS[n]} = {getattr(args, f'{n}_layers')} layers, {getattr(args, f'{n}_experts')} experts"
        for n in named
    )
    return (
        f"End to end ({', '.join(args.models)}; {shapes}{', tiny widths' if args.tiny else ''}); decode after "
        f"{args.context} tokens; ceilings: HBM {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="*", default=["hybrid_small", "kimi"], help="none: the start-up rows alone")
    p.add_argument("--quant", nargs="+", default=["none", "hierarchical"], choices=["none", "hierarchical"])
    p.add_argument("--quant-models", nargs="+", default=["hybrid_small"], help="models also run with --quant")
    p.add_argument("--ttft", type=int, nargs="*", default=[4096, 32768, 131072], help="none: decode rows only")
    p.add_argument("--batches", type=int, nargs="*", default=[1, 16, 64], help="none: TTFT rows only")
    p.add_argument(
        "--quant-ttft", type=int, nargs="*", default=None, help="TTFT lengths of quantized runs (default --ttft)"
    )
    p.add_argument("--context", type=int, default=2048)
    add_hf_args(p)
    p.add_argument("--tiny", action="store_true", help="the transformers-built models at widths / 16 (CPU smoke tests)")
    p.add_argument("--baseline-ttft", type=int, nargs="*", default=None, help="default: --ttft up to 32K")
    p.add_argument("--pallas-ops", nargs="*", default=None, help="ops whose Pallas kernel 'auto' must pick (e.g. moe)")
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--startup-config", default="hybrid_small", help="preset the start-up rows generate with")
    p.add_argument("--no-startup", action="store_true")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args()
    if not args.models and args.no_startup:
        raise SystemExit("e2e: no --models and --no-startup: nothing to measure")

    rows: list[dict] = []

    def emit(r: dict) -> None:
        rows.append(r)
        shown = {k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in r.items()}
        print("  " + " | ".join(f"{k}={v}" for k, v in shown.items()), flush=True)

    # The transformers side first, in its own processes, before JAX takes the GPU's memory.
    torch_rows = []
    for name in (m for m in args.models if m in HF_MODELS):
        ensure_hf_dir(args, name)
        if not args.no_baseline:
            ttft = args.baseline_ttft if args.baseline_ttft is not None else [t for t in args.ttft if t <= 32768]
            cmd = ["bench", str(hf_dir(args, name)), "--ttft", *map(str, ttft), "--batches",
                   *map(str, args.batches), "--context", str(args.context)]  # fmt: skip
            rows_t, _ = _torch_side(args.torch_python, cmd, timeout=1800)
            torch_rows += [dict(r, model=name) for r in rows_t]

    import jax

    from benchmarks.common import ceilings, report
    from pallas_kernels import OPS, use_pallas

    if args.pallas_ops and not set(args.pallas_ops) <= set(OPS):
        raise SystemExit(f"--pallas-ops {args.pallas_ops}: expected some of {OPS}")

    bw, rate = ceilings()
    print(f"measured ceilings: HBM {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
    for r in torch_rows:
        case = {"ttft": "TTFT", "decode": "decode step"}[r["case"]]
        fla = "fla kernels" if r.get("fla") else "no fla (torch fallback)"
        row = dict(
            model=r["model"], quant="none", case=case, batch=r["batch"], tokens=r["tokens"],
            engine=f"transformers, {fla}",
        )  # fmt: skip
        if "error" in r:
            emit(dict(row, note=r["error"]))
        else:
            tok = r["tokens"] if case == "TTFT" else r["batch"]
            emit(dict(row, ms=r["ms"], tok_s=tok / r["ms"] * 1e3, peak=r.get("peak_gib")))

    def switch():  # a fresh context each time: use_pallas() is entered once per model and quant
        return use_pallas(ops=args.pallas_ops) if args.pallas_ops else contextlib.nullcontext()

    engine = "hybrid-jax" + (f" (Pallas: {', '.join(args.pallas_ops)})" if args.pallas_ops else "")
    try:
        for name in args.models:
            for q in args.quant if name in args.quant_models else ["none"]:
                args_q = args
                if q != "none" and args.quant_ttft is not None:
                    args_q = argparse.Namespace(**dict(vars(args), ttft=args.quant_ttft))
                with switch():
                    measure_model(name, q, args_q, bw, rate, lambda r: emit(dict(r, engine=engine)))
                jax.clear_caches()
        if not args.no_startup:
            measure_startup(args.startup_config, lambda r: emit(dict(r, engine="hybrid-jax CLI")))
    except KeyboardInterrupt:  # Ctrl-C (or `timeout -s INT`): the rows measured so far still make the table
        print("interrupted: reporting the rows measured so far", flush=True)

    theirs = {
        (r["model"], r["case"], r["batch"], r["tokens"]): r["ms"]
        for r in rows
        if r["engine"].startswith("transformers") and "ms" in r
    }
    table = []
    for r in rows:
        key = (r["model"], r["case"], r["batch"], r["tokens"])
        speedup = ""
        if (
            r["engine"].startswith("hybrid-jax")
            and "CLI" not in r["engine"]
            and r["model"] in HF_MODELS
            and r["quant"] == "none"
            and key in theirs
            and "ms" in r
        ):
            speedup = f"{theirs[key] / r['ms']:.2f}x"
        table.append(
            {
                "model": r["model"], "quant": r["quant"], "engine": r["engine"], "case": r["case"],
                "batch": r["batch"], "tokens": r["tokens"] or "",
                "median ms": _fmt(r.get("ms"), ".2f"), "tokens/s": _fmt(r.get("tok_s"), ",.0f"),
                "floor ms": _fmt(r.get("floor_ms"), ".2f"),
                "% of floor": f"{r['floor_ms'] / r['ms']:.0%}" if r.get("floor_ms") and r.get("ms") else "",
                "peak GiB": _fmt(r.get("peak"), ".1f"), "vs transformers": speedup, "note": r.get("note", ""),
            }
        )  # fmt: skip
    title = run_title(args, bw, rate)
    report("e2e.py", title, table, record=not args.no_record)


if __name__ == "__main__":
    main()
