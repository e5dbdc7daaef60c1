"""Which GPU kernels one stage of a decode step runs, and how long each takes: a profiler trace of the
stage (chained calls in one executable) summarised per kernel. Prints the table (no benchmarks/results row: it
explains a number, it is not one) and writes the optimized HLO beside the trace to map kernel names to ops.

Stages of a decode step: one mixer (kda, sparse), the MoE FFN, or the whole step; `--stage verify` is a
speculative verify step instead (`--num-draft` + 1 tokens through the caches, then `commit` keeping one).
`--model kimi` is the Kimi-shaped Hugging Face folder of `benchmarks.e2e` (made there first if missing).
`--stage kda_prefill` is the KDA op alone at prefill (`--tokens`, 32 heads of 128, bf16, what `impl="auto"`
runs; `--varlen-seqs 8`: packed as that script's varlen batch), what `benchmarks.linear_attention` times, split
into its kernels. `--stage prefill` is the whole model's batch-1 prefill of `--tokens` (what the e2e TTFT row
times), split into its kernels.
`--stage indexer` is the indexer's decode Top-K alone (`indexer_topk`, 64 heads of 128, a BF16 pool of
`--context` keys, `--topk`, unsorted as the model asks) with each selection of `--selects`, what
`benchmarks.sparse_attention`'s decode rows time. `--stage topk` is the Top-K alone on [`--batch`, `--context`]
float32 normal scores with each of `--selects` (split, split_ranked, kernel, top_k: `sparse_attention`'s
`_selection`; split's tuning knobs after a colon, `split:pass_chunk=2048,num_warps=8`), what that script's
`--topk-rows` rows time.

    python -m benchmarks.profile_stage [--model hybrid_small|kimi]
        [--stage kda|sparse|moe|step|verify|kda_prefill|prefill|indexer|topk] [--num-draft 4] [--selects split top_k]
        [--batch 1 16] [--context 2048] [--tokens 32768] [--quant none|hierarchical] [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import device_events, flat_module
from benchmarks.e2e import HF_MODELS, add_hf_args, hf_model
from benchmarks.e2e_stages import _info


def kernel_times(trace_dir: Path) -> dict[str, list[float]]:
    """Device-side events of a perfetto trace: kernel name -> durations (us)."""
    out = collections.defaultdict(list)
    for _, dur, name in device_events(trace_dir):
        out[name].append(dur)
    return out


def profile_one(model, stage: str, layer: int, b: int, args, out_dir: Path) -> None:
    """Trace `args.calls` chained calls of the stage at batch b; print the per-kernel table."""
    cfg = model.config
    page = cfg.page_size
    cache = model.init_cache(b, -(-(args.context + args.calls + args.num_draft + 2) // page) * page)
    info = _info(cache, b, 1, args.context, "decode")
    x = jax.random.normal(jax.random.key(0), (b, 1, cfg.hidden_size), model.dtypes.compute)
    if stage in ("step", "verify"):  # the cache is carried through the loop, as in generate's (updated in place)
        from benchmarks.long_context import _random_like

        # every step reads `context` cached positions of small random values (zeros would tie every Top-K score)
        cache = _random_like(cache, jax.random.key(b)).replace(lengths=jnp.full((b,), args.context, jnp.int32))
        if stage == "step":
            module, call = model, lambda m, x, c: m.decode_step(jnp.zeros((b,), jnp.int32), c)
        else:  # k + 1 different tokens (they route to as many experts as a real block), one kept: the cache grows by 1
            block = jax.random.randint(jax.random.key(1), (b, args.num_draft + 1), 0, cfg.vocab_size, jnp.int32)
            keep = jnp.ones((b,), jnp.int32)

            def call(m, x, c):
                logits, pending = m.verify(block, c)
                return logits[:, 0], m.commit(pending, keep)

            module = model
        extra = (cache,)
    elif stage == "moe":
        module, call, extra = model.layers[layer].mlp, lambda m, x: m(x), ()
    else:
        module, call = model.layers[layer].self_attn, lambda m, x, i, s: m(x, i, s)[0]
        extra = (info, cache.layers[layer])
    leaves, rebuild = flat_module(module)

    def run(leaves, x, *a):
        m = rebuild(leaves)
        if stage in ("step", "verify"):

            def body(_, carry):
                x, c = carry
                logits, c = call(m, x, c)
                return x + (logits[:, None, :1] * 0).astype(x.dtype), c

            return jax.lax.fori_loop(0, args.calls, body, (x, *a))  # (x, cache): the cache goes on
        return jax.lax.fori_loop(0, args.calls, lambda _, x: x + call(m, x, *a).astype(x.dtype) * 0, x)

    fn = jax.jit(run, donate_argnums=(2,) if stage in ("step", "verify") else ())
    compiled = fn.lower(leaves, x, *extra).compile()
    hlo = compiled.as_text()
    (out_dir / f"{stage}_b{b}.hlo.txt").write_text(hlo)

    def call_once(extra):
        out = fn(leaves, x, *extra)
        jax.block_until_ready(out)
        return (out[1],) if stage in ("step", "verify") else extra  # the donated cache is replaced by the returned one

    extra = call_once(extra)
    trace = out_dir / f"trace_{stage}_b{b}"
    with jax.profiler.trace(str(trace), create_perfetto_trace=True):
        call_once(extra)
    print_table(f"{stage} stage (layer {layer}), B={b}", kernel_times(trace), args.calls, args.top, hlo_sources(hlo))


_SECTIONS = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def hlo_sources(hlo: str) -> dict[str, str]:
    """Kernel name (as the profiler prints it: the HLO instruction's, or its `deduplicated_name`'s, with "."
    as "_") -> "file.py:line (function)" of the innermost frame of this repository in the op's stack trace,
    read from the stack-frame tables at the top of the optimized HLO text. Pallas kernels carry their own
    names and are not listed."""
    tables: dict[str, dict[int, str]] = {k: {} for k in _SECTIONS}
    section = None
    for line in hlo.split("\n"):
        if line in _SECTIONS:
            section = line
        elif line.startswith(("%", "ENTRY", "HloModule")):
            if section == "StackFrames":
                break  # the tables precede the computations
            section = None
        elif section and (m := re.match(r"(\d+) (.*)$", line)):
            tables[section][int(m.group(1))] = m.group(2)
    fields = {k: {i: dict(re.findall(r"(\w+)=(\d+)", v)) for i, v in tables[k].items()}
              for k in ("FileLocations", "StackFrames")}  # fmt: skip
    root = str(Path(__file__).resolve().parents[1]) + "/"

    def source(frame: int) -> str | None:
        seen = set()
        while frame in fields["StackFrames"] and frame not in seen:
            seen.add(frame)
            f = fields["StackFrames"][frame]
            loc = fields["FileLocations"].get(int(f["file_location_id"]), {})
            path = tables["FileNames"].get(int(loc.get("file_name_id", -1)), "").strip('"')
            if path and "site-packages" not in path and not path.startswith("<"):
                fn = tables["FunctionNames"].get(int(loc.get("function_name_id", -1)), "").strip('"')
                return f"{path.replace(root, '')}:{loc.get('line')} ({fn})"
            frame = int(f["parent_frame_id"])
        return None

    out = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%([\w.\-]+) = [^\n]*?stack_frame_id=(\d+)", hlo, re.M):
        line_end = hlo.find("\n", m.start())
        dedup = re.search(r'deduplicated_name="([\w.\-]+)"', hlo[m.start() : line_end])
        where = source(int(m.group(2)))
        if where:
            for name in (m.group(1), dedup.group(1) if dedup else None):
                if name:
                    out.setdefault(name.replace(".", "_"), where)
    return out


def print_table(title: str, times: dict[str, list[float]], calls: int, top: int, sources=None) -> None:
    """The kernels by time per call; with `sources` (`hlo_sources`) a column with each XLA kernel's source."""
    total = sum(sum(v) for v in times.values()) / calls
    launches = sum(len(v) for v in times.values()) / calls
    print(f"\n{title}: {total:.1f} us of kernels per call, {launches:.0f} kernels per call")
    head = "| kernel | launches per call | us per call | share |" + (" source |" if sources is not None else "")
    print(head + "\n" + "|---" * head.count(" |") + "|")
    for name, ds in sorted(times.items(), key=lambda kv: -sum(kv[1]))[:top]:
        per = sum(ds) / calls
        src = "" if sources is None else f" {sources.get(name, '')} |"
        print(f"| {name[:90]} | {len(ds) / calls:g} | {per:.1f} | {per / total:.0%} |{src}")


def profile_kda_prefill(tokens: int, args, out_dir: Path) -> None:
    """The KDA op at prefill, bf16 inputs, what "auto" runs (on sm_90 the Mosaic GPU state pass)."""
    from benchmarks.linear_attention import DK, DV, N, varlen_offsets
    from pallas_kernels.linear_attention import kda

    ks = jax.random.split(jax.random.key(tokens), 5)
    q, k, v = (jax.random.normal(x, (1, tokens, N, DK), jnp.bfloat16) for x in ks[:3])
    g = -jax.nn.softplus(jax.random.normal(ks[3], (1, tokens, N, DK))) * 0.1
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (1, tokens, N)))
    cu = varlen_offsets(tokens, args.varlen_seqs) if args.varlen_seqs else None
    fn = jax.jit(lambda *a: kda(*a, cu_seqlens=cu))
    jax.block_until_ready(fn(q, k, v, g, beta))
    trace = out_dir / f"trace_kda_prefill_{tokens}"
    with jax.profiler.trace(str(trace), create_perfetto_trace=True):
        for _ in range(args.calls):
            out = fn(q, k, v, g, beta)
        jax.block_until_ready(out)
    title = f"KDA prefill T={tokens} N={N} K={DK} V={DV}, bf16 products (defaults)"
    if cu is not None:
        title += f", {args.varlen_seqs} packed sequences (lengths {np.diff(cu).tolist()})"
    print_table(title, kernel_times(trace), args.calls, args.top)


def profile_indexer(b: int, args, out_dir: Path) -> None:
    """The indexer's decode Top-K at batch b (one query per row at the last of `args.context` keys), once per
    selection in `args.selects`, `sort=False`."""
    from benchmarks.sparse_attention import _pool
    from pallas_kernels.indexer import indexer_topk

    heads, dim, s = 64, 128, args.context
    ks = jax.random.split(jax.random.key(s + b), 3)
    pool, table = _pool(ks[0], b, s, dim, jnp.bfloat16)
    q = jax.random.normal(ks[1], (b, 1, heads, dim), jnp.bfloat16)
    w = jax.random.normal(ks[2], (b, 1, heads), jnp.float32)
    kw = dict(q_positions=jnp.full((b, 1), s - 1, jnp.int32), kv_lengths=jnp.full((b,), s, jnp.int32),
              topk=args.topk, scale=dim**-0.5, impl="pallas", sort=False)  # fmt: skip
    for select in args.selects:
        fn = jax.jit(lambda q, w, p, t, select=select: indexer_topk(q, w, p, t, select=select, **kw)[0])
        jax.block_until_ready(fn(q, w, pool, table))
        trace = out_dir / f"trace_indexer_{select}_b{b}"
        with jax.profiler.trace(str(trace), create_perfetto_trace=True):
            for _ in range(args.calls):
                out = fn(q, w, pool, table)
            jax.block_until_ready(out)
        title = f"indexer decode B={b} S={s} {heads}x{dim} top-{args.topk}, select={select}, unsorted"
        print_table(title, kernel_times(trace), args.calls, args.top)


TOPK_SELECTS = {"split": ("split", False), "split_ranked": ("split", True), "kernel": ("kernel", False)}
# split / split_ranked take `top_k_split`'s tuning knobs after a colon: "split:pass_chunk=2048,num_warps=8"
SPLIT_KNOBS = ("seg", "num_warps", "select_warps", "pass_chunk")


def parse_topk_select(spec: str) -> tuple[str, dict[str, int]]:
    """A select spec, name[:knob=int,...] -> (name, knobs); ValueError naming the spec when it is not one."""
    name, _, rest = spec.partition(":")
    if name not in (*TOPK_SELECTS, "top_k"):
        raise ValueError(f"--selects {spec}: the topk stage takes {', '.join([*TOPK_SELECTS, 'top_k'])}")
    knobs = {}
    for item in filter(None, rest.split(",")):
        key, _, val = item.partition("=")
        if not name.startswith("split") or key not in SPLIT_KNOBS or not val.isdigit():
            raise ValueError(f"--selects {spec}: knobs are split's {', '.join(SPLIT_KNOBS)} as name=int")
        knobs[key] = int(val)
    return name, knobs


def profile_topk(rows: int, args, out_dir: Path) -> None:
    """The Top-K alone of [rows, args.context] float32 normal scores, once per selection in `args.selects`
    ("top_k": `lax.top_k`), each call a separate dispatch."""
    from benchmarks.sparse_attention import _selection

    s, k = args.context, args.topk
    x = jax.random.normal(jax.random.key(rows + s), (rows, s), jnp.float32)
    for n, select in enumerate(args.selects):
        name, knobs = parse_topk_select(select)
        if name == "top_k":
            fn = jax.jit(lambda x: jax.lax.top_k(x, k))
        else:
            fn = _selection(*TOPK_SELECTS[name], s, k, **knobs)
        jax.block_until_ready(fn(x))
        trace = out_dir / f"trace_topk_{n}_{name}_r{rows}"
        with jax.profiler.trace(str(trace), create_perfetto_trace=True):
            for _ in range(args.calls):
                out = fn(x)
            jax.block_until_ready(out)
        print_table(
            f"Top-{k} of [{rows}, {s}] float32 normal scores, {select}", kernel_times(trace), args.calls, args.top
        )


def profile_prefill(model, tokens: int, args, out_dir: Path) -> None:
    """The whole model's batch-1 prefill (cache allocation + prefill, last position's logits), as the e2e
    TTFT row times it; `args.calls` calls traced. With --prefill-chunk, the same prompt through
    `prefill_chunked` as well, and the two compared per source line of the model (what the chunks cost extra)."""
    from hybrid_jax.generate import prefill_chunked

    cfg = model.config
    leaves, rebuild = flat_module(model)
    ids = jax.random.randint(jax.random.key(tokens), (1, tokens), 0, cfg.vocab_size - 8, jnp.int32)
    per_source = {}
    for chunk in (None, *([args.prefill_chunk] if args.prefill_chunk else [])):

        def run(leaves, ids, chunk=chunk):
            m = rebuild(leaves)
            cache = m.init_cache(1, -(-(tokens + 1) // cfg.page_size) * cfg.page_size)
            if chunk is None:
                return jnp.argmax(m.prefill(ids, cache, last_only=True)[0], axis=-1)
            return jnp.argmax(prefill_chunked(m, ids, cache, jnp.array([tokens]), chunk=chunk)[0], axis=-1)

        fn = jax.jit(run)
        hlo = fn.lower(leaves, ids).compile().as_text()
        name = f"prefill_{tokens}" + (f"_chunk{chunk}" if chunk else "")
        (out_dir / f"{name}.hlo.txt").write_text(hlo)
        jax.block_until_ready(fn(leaves, ids))
        walls = []
        for _ in range(max(3, args.calls)):  # wall clock outside the profiler: kernels plus whatever lies between
            t0 = time.perf_counter()
            jax.block_until_ready(fn(leaves, ids))
            walls.append((time.perf_counter() - t0) * 1e3)
        trace = out_dir / f"trace_{name}"
        with jax.profiler.trace(str(trace), create_perfetto_trace=True):
            for _ in range(args.calls):
                out = fn(leaves, ids)
            jax.block_until_ready(out)
        times, sources = kernel_times(trace), hlo_sources(hlo)
        title = f"prefill T={tokens}, B=1" + (f", chunks of {chunk}" if chunk else ", one call")
        print_table(title, times, args.calls, args.top, sources)
        print(f"wall clock: {statistics.median(walls):.1f} ms per call (median of {len(walls)})")
        grouped = collections.defaultdict(float)
        for k, ds in times.items():
            grouped[sources.get(k) or k.split("_")[0]] += sum(ds) / args.calls
        per_source[chunk] = grouped
    if len(per_source) == 2:
        one, chunked = per_source[None], per_source[args.prefill_chunk]
        diff = sorted(set(one) | set(chunked), key=lambda s: -abs(chunked.get(s, 0) - one.get(s, 0)))
        print(f"\nchunks of {args.prefill_chunk} minus one call, per source (us per prefill):")
        print("| source | one call | chunked | difference |\n|---|---|---|---|")
        for src in diff[: args.top]:
            a, b = one.get(src, 0.0), chunked.get(src, 0.0)
            print(f"| {src[:90]} | {a:.0f} | {b:.0f} | {b - a:+.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="hybrid_small", help="a preset, or kimi / glm5 (e2e's folders)")
    p.add_argument(
        "--stage", default="kda",
        choices=["kda", "sparse", "moe", "step", "verify", "kda_prefill", "prefill", "indexer", "topk"],
    )  # fmt: skip
    p.add_argument("--num-draft", type=int, default=4, help="verify only: a block of num_draft + 1 tokens")
    p.add_argument("--tokens", type=int, default=32768, help="kda_prefill and prefill only")
    varlen = "kda_prefill: the tokens packed as this many sequences (linear_attention's varlen batch); 0: one"
    p.add_argument("--varlen-seqs", type=int, default=0, help=varlen)
    p.add_argument("--prefill-chunk", type=int, default=None, help="prefill only: also chunked, and the difference")
    p.add_argument("--layers", type=int, default=None, help="a preset cut to this many layers (gpu_parity.cut_config)")
    p.add_argument("--experts", type=int, default=32, help="with --layers: at most this many routed experts")
    p.add_argument("--quant", default="none", choices=["none", "hierarchical"], help="the model's quant config")
    add_hf_args(p)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--topk", type=int, default=2048, help="indexer and topk only")
    selects = "indexer: indexer_topk selects; topk: split[:knob=int,...], split_ranked, kernel, top_k"
    p.add_argument("--selects", nargs="+", default=["split", "top_k"], help=selects)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", type=Path, default=None, help="folder for traces and HLO (default: a temp folder)")
    args = p.parse_args()
    from benchmarks.e2e import build_model

    out_dir = args.out or Path(tempfile.mkdtemp(prefix="profile_stage_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.stage == "kda_prefill":
        if not 0 <= args.varlen_seqs <= args.tokens:
            p.error(f"--varlen-seqs {args.varlen_seqs}: must be in [0, {args.tokens}] (the tokens)")
        profile_kda_prefill(args.tokens, args, out_dir)
        return
    if args.stage == "topk":
        for select in args.selects:
            try:
                parse_topk_select(select)
            except ValueError as e:
                p.error(str(e))
    if args.stage in ("indexer", "topk"):
        for b in args.batch:
            (profile_indexer if args.stage == "indexer" else profile_topk)(b, args, out_dir)
        return
    # bf16 weights; --quant hierarchical: MXFP8 indexer keys and an FP8 latent cache as well
    if args.layers is not None and args.model not in HF_MODELS:
        from flax import nnx

        from benchmarks.gpu_parity import cut_config
        from hybrid_jax import PRESETS, HybridLM

        cfg = cut_config(PRESETS[args.model](), args.layers, args.experts)
        model = HybridLM(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    elif args.model in HF_MODELS:
        model = hf_model(args, args.model, args.quant)
    else:
        model = build_model(args.model, args.quant)
    if args.stage == "prefill":
        profile_prefill(model, args.tokens, args, out_dir)
        print(f"\ntraces and HLO in {out_dir}")
        return
    cfg = model.config
    kind = {"kda": "linear", "sparse": "sparse"}.get(args.stage)
    layer = next((i for i, t in enumerate(cfg.layer_types) if kind is None or t == kind), 0)
    if args.stage == "moe":
        layer = cfg.mlp_types.index("moe")
    for b in args.batch:
        profile_one(model, args.stage, layer, b, args, out_dir)
    print(f"\ntraces and HLO in {out_dir}")


if __name__ == "__main__":
    main()
