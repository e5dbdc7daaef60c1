"""Shared pieces of the benchmark scripts: timing, floors, table formatting, recording rows as JSONL
(benchmarks/results/<script>.jsonl; `python -m benchmarks.report` makes BENCHMARKS.md of them)."""

from __future__ import annotations

import datetime
import functools
import gzip
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def device_name() -> str:
    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', d.platform)} x{jax.device_count()}, jax {jax.__version__}"


@functools.cache
def commit() -> str:
    """HEAD of the checkout; HYBRID_JAX_COMMIT overrides it where the tree was copied without .git (GPU runs)."""
    if os.environ.get("HYBRID_JAX_COMMIT"):
        return os.environ["HYBRID_JAX_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except OSError:
        return "unknown"


def median_ms(fn, warmup: int = 3, iters: int = 20, calls: int = 1) -> float:
    """Median wall ms of fn() over `iters` timings. With calls > 1 each timing dispatches fn `calls` times
    back to back (JAX queues them) and waits once, per call: the host's dispatch and wait (~0.1-0.2 ms on the
    H200) are paid once per timing, as a CUDA-event timing of PyTorch code does not pay them at all."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        outs = [fn() for _ in range(calls)]
        jax.block_until_ready(outs)
        ts.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(ts)


CHAIN = 10


def _chain(fn, n: int):
    """fn run n times in one jitted function, each call's first argument made to depend on the previous
    call's output (see `chained_ms`)."""

    def chain(first, *rest):
        for _ in range(n):
            out = fn(first, *rest)
            leaf = jax.tree.leaves(out)[0].ravel()[0]
            first = first + (leaf == -1234567).astype(first.dtype)
        return first

    return jax.jit(chain)


def chained_ms(fn, *args, n: int = CHAIN, warmup: int = 1, iters: int = 10) -> float:
    """Median ms per call of fn(*args) run n times in one executable, each call's first argument made to
    depend on the previous call's output: what an op costs inside a compiled step, without the per-dispatch
    host overhead (~0.1-0.2 ms on the H200, larger than a decode-sized kernel). The dependency is a zero
    XLA cannot fold (an output element compared with a value it never takes) added to args[0]: one tiny
    fusion per call, so it also keeps XLA from merging or hoisting the repeated calls."""
    chained = _chain(fn, n)
    return median_ms(lambda: chained(*args), warmup=warmup, iters=iters) / n


@functools.cache
def fresh_program(fn, n: int):
    """One jitted program running fn on n argument tuples one after another (see `fresh_ms`): each call's
    inputs pass an optimization barrier together with the previous call's whole output, which keeps the calls
    in order and stops XLA from fusing one call's ops with another's; every output is returned, so none is
    dropped. Cached per (fn, n), so `fresh_ms` and `fresh_device_ms` of one fn compile it once."""

    def run(calls):
        if len(calls) != n:
            raise ValueError(f"fresh_program: {len(calls)} argument tuples for a program of n={n} calls")
        outs, prev = [], None
        for args in calls:
            if prev is not None:
                args, _ = jax.lax.optimization_barrier((args, prev))
            prev = fn(*args)
            outs.append(prev)
        return outs

    return jax.jit(run)


def fresh_ms(fn, calls: list[tuple], warmup: int = 1, iters: int = 10) -> float:
    """Median wall ms per call of fn over `calls` (argument tuples, each with its own arrays), run one after
    another in one executable (`fresh_program`): no host dispatch per call (what an op costs inside a compiled
    step), and nothing for XLA to hoist out of the calls or share between them — each call reads its own
    inputs. Arrays fn closes over, or that are the same in every tuple, are shared (say so where they are big).
    The executable's own launch and wait (~0.3-0.5 ms on the H200) is spread over the calls: use enough calls,
    or `fresh_device_ms`, for calls of tens of microseconds."""
    run = fresh_program(fn, len(calls))
    return median_ms(lambda: run(calls), warmup=warmup, iters=iters) / len(calls)


def fresh_device_ms(fn, calls: list[tuple], reps: int = 3) -> float | None:
    """Device ms per call of the `fresh_ms` program: from a profiler trace of one execution, its first
    kernel's start to its last kernel's end, over the number of calls (median of `reps` executions, each traced
    alone) — `fresh_ms` less the executable's launch and wait; the gaps between kernels stay in. None where the
    trace has no device events (CPU)."""
    run = fresh_program(fn, len(calls))
    return _device_span_ms(lambda: run(calls), len(calls), reps)


def _device_span_ms(call, n: int, reps: int) -> float | None:
    """call()'s first kernel start to last kernel end over n, median of `reps` traced executions; None without
    device events."""
    return _traced_ms(call, lambda events: max(t + dur for t, dur, _ in events) - events[0][0], n, reps)


def dispatched_kernel_ms(fn, *args, calls: int = CHAIN, reps: int = 3) -> float | None:
    """Kernel ms per call of `calls` separate dispatches of fn queued back to back: the summed durations of the
    device events in a profiler trace of those calls, over `calls` (median of `reps` traced runs). The wall
    time of separate dispatches includes the host's dispatch, which calls of tens of microseconds wait on;
    this leaves it and the gaps between kernels out. None where the trace has no device events (CPU)."""
    run = lambda: [fn(*args) for _ in range(calls)]  # noqa: E731
    return _traced_ms(run, lambda events: sum(dur for _, dur, _ in events), calls, reps)


def _traced_ms(call, measure, n: int, reps: int) -> float | None:
    """measure(device events of one traced call(), in us) / n in ms, median of `reps` traces after one untraced
    call; None without device events."""
    jax.block_until_ready(call())
    values = []
    for _ in range(reps):
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d, create_perfetto_trace=True):
                jax.block_until_ready(call())
            events = device_events(Path(d))
        if not events:
            return None
        values.append(measure(events) / 1e3 / n)
    return statistics.median(values)


def device_events(trace_dir: Path) -> list[tuple[float, float, str]]:
    """(start us, duration us, name) of the device-side events of the perfetto trace under trace_dir, by start:
    the newest one there (a directory traced into again keeps the earlier runs' traces beside it)."""
    paths = list(Path(trace_dir).rglob("perfetto_trace.json.gz"))
    if not paths:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    path = max(paths, key=lambda p: p.stat().st_mtime_ns)
    events = json.loads(gzip.decompress(path.read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {pid for pid, n in names.items() if "GPU" in n or "device" in n.lower() and "host" not in n.lower()}
    return sorted(
        (float(e.get("ts", 0.0)), float(e.get("dur", 0.0)), e["name"])
        for e in events
        if e.get("ph") == "X" and e.get("pid") in device
    )


def chained_device_ms(fn, *args, n: int = CHAIN, reps: int = 3) -> float | None:
    """Device ms per call of the `chained_ms` executable: from a profiler trace of one execution, its first
    kernel's start to its last kernel's end, over n (median of `reps` executions, each traced alone). What
    `chained_ms` times less the executable's launch and wait, which its n calls share (H200, the indexer's
    B=1 decode at 40 calls: ~5 us a call, more than a tenth of it); the gaps between the calls' kernels stay
    in. None where the trace has no device events (CPU)."""
    chained = _chain(fn, n)
    return _device_span_ms(lambda: chained(*args), n, reps)


def flat_module(module):
    """(the module's arrays as one flat list, leaves -> the module again, for inside a trace)."""
    from flax import nnx

    graphdef, state = nnx.split(module)
    leaves, treedef = jax.tree.flatten(state)
    return leaves, lambda leaves: nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


def jit_module(fn, module, **jit_kwargs):
    """`jax.jit` of `fn(module, *args)` called as `f(*args)`: the module's arrays go in as one flat list.

    Handing an `nnx.Module` to `jax.jit` walks its object graph on the host at every call (hybrid_small:
    ~3.5 ms per call on the 2-core CI machine, 452 arrays) — more than a decode step's device time. Split
    once here, a call flattens a list. `donate_argnums` count the caller's arguments (the list is not one).
    """
    leaves, rebuild = flat_module(module)
    if "donate_argnums" in jit_kwargs:
        donate = jit_kwargs["donate_argnums"]
        jit_kwargs["donate_argnums"] = tuple(i + 1 for i in ((donate,) if isinstance(donate, int) else donate))
    jitted = jax.jit(lambda leaves, *a: fn(rebuild(leaves), *a), **jit_kwargs)

    def call(*a):
        return jitted(leaves, *a)

    call.lower = lambda *a: jitted.lower(leaves, *a)  # for the compiled executable's memory analysis
    return call


def loop_ms(fn, module, x, *args, n: int = 20, reps: int = 5, carry=None) -> float:
    """Device time of one `fn(module, x, *args)` call: n calls chained in one `lax.fori_loop` (each call's x
    depends on the call before, so nothing is hoisted out of the loop); median of `reps` timed loops, over
    n. No host dispatch in the number: what the call costs inside a compiled loop such as `generate`'s.

    carry: for a call that updates its last argument in place (a layer's cache state), where its output holds
    the updated one (`carry(output)`): that argument is carried from call to call and donated, as generate's
    loop does — a constant one would make XLA copy it before every in-place kernel, a copy generate does not
    make. The caller's last argument is consumed."""
    leaves, rebuild = flat_module(module)

    def run(leaves, x, *a):
        m = rebuild(leaves)

        def body(_, x):
            first = jax.tree.leaves(fn(m, x, *a))[0]
            return x + (jnp.sum(first.astype(jnp.float32)) * 0).astype(x.dtype)  # x*0 is kept: NaN semantics

        def carried(_, xs):
            x, state = xs
            out = fn(m, x, *a[:-1], state)
            first = jax.tree.leaves(out)[0]
            return x + (jnp.sum(first.astype(jnp.float32)) * 0).astype(x.dtype), carry(out)

        if carry is None:
            return jax.lax.fori_loop(0, n, body, x)
        return jax.lax.fori_loop(0, n, carried, (x, a[-1]))

    if carry is None:
        looped = jax.jit(run)
        return median_ms(lambda: looped(leaves, x, *args), warmup=1, iters=reps) / n
    looped = jax.jit(run, donate_argnums=(len(args) + 1,))
    box = {"state": args[-1]}

    def call():
        _, box["state"] = looped(leaves, x, *args[:-1], box["state"])
        return box["state"]

    return median_ms(call, warmup=1, iters=reps) / n


def decode_loop(model, n: int, count_experts: bool = False):
    """f(tok [B] int32, cache) -> (tok, cache) after n greedy decode steps in one executable (argmax fed
    back, cache donated): the loop `generate` compiles, without its stopping and sampling.

    count_experts: also return counts [n, MoE layers] int32, the distinct routed experts the step's B tokens
    chose in each MoE layer (what `e2e.decode_floor_bytes(touched=)` reads), -1 where the router returned an
    id outside [0, experts) (NaN scores pick none). The router's choices are taken where the layer asks
    `record_router` for them; the counting adds work, so a timed loop runs without it."""
    from hybrid_jax.inspect import record_router

    experts, layers = model.config.num_experts, model.config.mlp_types.count("moe")
    if count_experts and not layers:
        raise ValueError(f"decode_loop: count_experts=True on a model without MoE layers: {model.config.mlp_types}")

    def step(m, tok, cache):
        if not count_experts:
            return m.decode_step(tok, cache), None
        with record_router(traced=True) as routes:  # inside the trace: the records are this step's tracers
            out = m.decode_step(tok, cache)
        chosen = [r["indices"] for r in routes]
        if len(chosen) != layers:  # the step routes once per MoE layer: anything else is not what was counted
            raise ValueError(f"decode_loop: {len(chosen)} routings in a step of {layers} MoE layers")
        hit = []
        for idx in chosen:  # one slot past the experts collects out-of-range ids (.at[] would drop them)
            idx = idx.reshape(-1)
            seen = jnp.zeros((experts + 1,), jnp.int32).at[jnp.where((idx >= 0) & (idx < experts), idx, experts)].max(1)
            hit.append(jnp.where(seen[experts] > 0, -1, seen[:experts].sum()))
        return out, jnp.stack(hit)

    def steps(m, tok, cache):
        def body(i, carry):
            (logits, cache), hit = step(m, carry[0], carry[1])
            tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            return (tok, cache) if hit is None else (tok, cache, carry[2].at[i].set(hit))

        if not count_experts:
            return jax.lax.fori_loop(0, n, body, (tok, cache))
        return jax.lax.fori_loop(0, n, body, (tok, cache, jnp.zeros((n, layers), jnp.int32)))

    return jit_module(steps, model, donate_argnums=1)


def ceilings(repeats: int = 3, copy_elems: int = 1 << 30, mm: int = 8192) -> tuple[float, float]:
    """Measured memory bandwidth (bytes/s) and bf16 matmul rate (FLOP/s) on this device, each the best of
    `repeats` medians. One median read from 3.19 to 3.76 TB/s and from 495 to 681 TFLOP/s between runs of
    2026-11-30, swinging every floor with it; a floor is what the device can do, so it takes the best it
    showed. The bandwidth is the better of two rates over the same 4 GiB: a copy (read + write, both bytes
    counted) and a read alone (a sum: row sums of 8,192 values, and one scalar). Decode floors are mostly
    weights read, and HBM reads alone go faster than a copy's mix (on an H100 the lm_head GEMM read 3.11
    TB/s where copies measured 2.5-2.8), so a copy-rate floor was not a lower bound there. The matmul and
    the sums queue 5 calls per host dispatch and wait (a call is ~1-2 ms); the copy is timed one call at a
    time, since each queued call would hold its own 4 GiB output. copy_elems: a multiple of 8,192 (the row
    sums' width) or fewer."""
    x = jnp.ones((copy_elems,), jnp.float32)  # 4 GiB: far past the L2
    copy = jax.jit(lambda x: x * 1.5 + 1.0)
    median_ms(lambda: copy(x), warmup=20, iters=1)  # long warm-up: the clocks ramp from idle
    ms = min(median_ms(lambda: copy(x), warmup=0, iters=10) for _ in range(repeats))
    rates = {"copy": 2 * x.nbytes / (ms * 1e-3)}
    width = min(8192, copy_elems)
    for name, read in (
        ("row sums", jax.jit(lambda x: x.reshape(-1, width).sum(axis=1))),
        ("sum", jax.jit(lambda x: x.sum())),
    ):
        median_ms(lambda read=read: read(x), warmup=3, iters=1)
        ms = min(median_ms(lambda read=read: read(x), warmup=0, iters=10, calls=5) for _ in range(repeats))
        rates[name] = x.nbytes / (ms * 1e-3)
    print("HBM ceiling, the best of: " + ", ".join(f"{k} {v / 1e12:.2f} TB/s" for k, v in rates.items()), flush=True)
    bw = max(rates.values())
    a = jax.random.normal(jax.random.key(0), (mm, mm), jnp.bfloat16)
    matmul = jax.jit(lambda a: a @ a)
    median_ms(lambda: matmul(a), warmup=10, iters=1)
    ms = min(median_ms(lambda: matmul(a), warmup=0, iters=10, calls=5) for _ in range(repeats))
    return bw, 2 * mm**3 / (ms * 1e-3)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def roofline_row(case, shape, impl, ms, flops, nbytes, bw, rate, check="") -> dict:
    """One timed row: rates achieved and the share of the floor max(FLOPs / rate, bytes / bandwidth)."""
    floor = max(flops / rate, nbytes / bw) * 1e3
    # one line per row as it is measured: a run cut short by a time limit still shows what it got
    print(f"  {case} | {shape} | {impl}: {ms:.3f} ms, {floor / ms:.0%} of floor {check}", flush=True)
    return {
        "case": case,
        "shape": shape,
        "impl": impl,
        "median ms": f"{ms:.3f}",
        "TFLOP/s": f"{flops / ms / 1e9:.1f}",
        "GB/s": f"{nbytes / ms / 1e6:,.0f}",
        "% of floor": f"{floor / ms:.0%}",
        "check vs reference": check,
    }


def format_table(rows: list[dict]) -> str:
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


RESULTS = ROOT / "benchmarks" / "results"
RESULTS_DIR_ENV = "HYBRID_JAX_RESULTS_DIR"

# Columns that hold what a run measured; every other column names what was measured (the row's identity). A new
# script's measurement columns belong here: one left out becomes identity, and every run of the row a new key.
VALUE_COLUMNS = frozenset({
    "median ms", "TFLOP/s", "GB/s", "% of floor", "check vs reference", "rel err vs ref", "compile + first call",
    "tokens/s", "floor ms", "peak GiB", "vs transformers", "note", "ms each", "ms x layers", "share of full call",
    "kernels", "ms per call", "most common", "ms per step", "x floor", "command buffers", "kernels per step",
    "prefill_err", "decode_err", "greedy", "warps", "stages", "smem", "regs", "spills", "verdict", "result", "error",
    "ms", "tokens per verify step", "gathered GB/s", "% of tensor bound", "vs plain", "max rel err vs plain",
    "float32 rel err vs plain (logits; worst cache leaf)", "bf16 bytes", "quantized bytes", "ratio", "mean recall",
    "min recall", "latent rel err", "output rel err", "mean KL (nats)", "max KL", "argmax agreement", "seconds",
    "per-device scores (x1e6)", "max / min", "max / mean", "checkpoint MB", "largest tensor MB",
    "RSS after imports MB", "peak RSS MB", "peak - imports - model MB", "load s", "speed-up vs first",
    "check vs first", "vs one shot", "vs plain at byte floors",
})  # fmt: skip
# Identity columns that name the variant compared on one shape (implementation, engine, options...): the rest of
# the identity is the shape, and a row of the same shape whose variant is a reference is its baseline.
VARIANT_COLUMNS = frozenset({
    "impl", "engine", "path", "mesh", "options", "compiler_options", "pallas ops", "version", "stage", "layers",
    "kernel", "loop", "tile (heads, rows, warps, stages)", "rows", "format", "vs", "layout", "block",
})  # fmt: skip
BASELINE = re.compile(r"^(jnp reference|reference$|XLA dot$|lax\.ragged_dot|plain$|transformers|default$)")
# The row's main number: the first of these columns that holds one, with its unit.
MAIN_VALUE = (
    ("median ms", "ms"), ("ms per step", "ms"), ("ms per call", "ms"), ("ms each", "ms"), ("ms", "ms"),
    ("ms x layers", "ms"), ("load s", "s"), ("mean recall", "recall"), ("output rel err", "rel err"),
    ("mean KL (nats)", "nats"), ("ratio", "x"), ("max / mean", "x"), ("kernels", "kernels"),
)  # fmt: skip
# Parts of a title measured in the run (the ceilings, the models run): kept in the row's `run`, not its table.
TITLE_RUN_PARTS = (
    ("ceilings", re.compile(r";\s*ceilings(?: measured in this run)?: (.*)$")),
    ("bandwidth", re.compile(r";\s*floor = bytes over the measured (?:copy|HBM) bandwidth (.*)$")),
    ("bf16 matmul", re.compile(r";\s*bf16 matmul measured at (.*)$")),
    ("models", re.compile(r"^End to end \(([^;()]*); ")),
    ("kernels", re.compile(r": (\d+ kernels, \d+ over [\d,]+ bytes of shared memory)")),
)


def results_dir() -> Path:
    """Where `report` appends rows: $HYBRID_JAX_RESULTS_DIR (tests; a GPU run writing under $OUT), else
    benchmarks/results (`RESULTS`, what BENCHMARKS.md is made of)."""
    return Path(os.environ.get(RESULTS_DIR_ENV) or RESULTS)


def split_title(title: str) -> tuple[str, dict]:
    """(the table's identity, the title's run-specific parts): "Sparse-attention kernels; ceilings measured in this
    run: copy 3.75 TB/s, ..." is the table "Sparse-attention kernels" measured with those ceilings."""
    run = {}
    for name, pattern in TITLE_RUN_PARTS:
        m = pattern.search(title)
        if m:
            run[name] = m.group(1).strip()
            keep = "End to end (" if name == "models" else ""
            title = title[: m.start()] + keep + title[m.end() :]
    return title.strip(), run


def number(text) -> float | None:
    """The leading number of a cell ("1,997", "23%", "47.8 s", "9.9x"), or None."""
    m = re.match(r"\s*([-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)", str(text))
    return float(m.group(1).replace(",", "")) if m else None


def result_rows(script: str, title: str, rows: list[dict], **fields) -> list[dict]:
    """The JSONL records of one table: per row the run's fields (date, commit, device, jax...), the script, the table
    (`split_title`), the row's columns as text, its identity columns, its main value and unit, and the baseline
    (the row of the same shape whose variant is a reference, in the same table) where there is one."""
    table, run = split_title(title)
    records = []
    for row in rows:
        columns = {str(k): str(v) for k, v in row.items()}
        identity = [c for c in columns if c not in VALUE_COLUMNS]
        rec = {**fields, "script": script, "table": table}
        if run:
            rec["run"] = run
        rec.update(identity=identity, columns=columns)
        for col, unit in MAIN_VALUE:
            if number(columns.get(col, "")) is not None:
                rec.update(metric=col, value=number(columns[col]), unit=unit)
                break
        records.append(rec)
    for rec in records:
        shape = shape_of(rec)
        if any(BASELINE.match(rec["columns"][c]) for c in rec["identity"] if c in VARIANT_COLUMNS):
            continue  # a reference itself
        for other in records:
            variant = [c for c in other["identity"] if c in VARIANT_COLUMNS]
            if (
                "value" in other
                and other.get("metric") == rec.get("metric")
                and shape_of(other) == shape
                and any(BASELINE.match(other["columns"][c]) for c in variant)
            ):
                rec["baseline"] = {c: other["columns"][c] for c in variant} | {
                    "value": other["value"],
                    "unit": other["unit"],
                }
                break
    return records


def shape_of(rec: dict) -> tuple:
    """The identity columns of a record that are not its variant: what it was measured on."""
    return tuple((c, rec["columns"][c]) for c in rec["identity"] if c not in VARIANT_COLUMNS)


def row_key(rec: dict) -> tuple:
    """What a record measured: script, table and identity columns. Of the records with one key the latest counts."""
    return (rec["script"], rec["table"], tuple((c, rec["columns"][c]) for c in rec["identity"]))


def run_fields() -> dict:
    """date (UTC, ISO), commit, device, jax version and command-line arguments of this run."""
    d = jax.devices()[0]
    fields = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": commit(),
        "device": f"{d.platform}:{getattr(d, 'device_kind', d.platform)} x{jax.device_count()}",
        "jax": jax.__version__,
    }
    return fields | ({"args": " ".join(sys.argv[1:])} if sys.argv[1:] else {})


def append_results(script: str, title: str, rows: list[dict], directory: Path | None = None) -> Path:
    """Append one record per row to <directory>/<script>.jsonl (`results_dir()` by default); returns the file.
    Append-only: a copy of the file from another machine holds every row of ours plus its own."""
    path = Path(directory or results_dir()) / f"{Path(script).stem}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r, ensure_ascii=False) + "\n" for r in result_rows(script, title, rows, **run_fields())]
    with path.open("a", encoding="utf-8") as f:
        f.writelines(lines)
    return path


def report(script: str, title: str, rows: list[dict], *, record: bool = True) -> None:
    """Print a titled table (with the device) and, unless record=False, append its rows to
    benchmarks/results/<script>.jsonl (`append_results`); `python -m benchmarks.report` makes BENCHMARKS.md of them."""
    table = format_table(rows)
    print(f"\n{title}\ndevice: {device_name()}\n{table}", flush=True)
    if record:
        path = append_results(script, title, rows)
        print(f"{len(rows)} rows appended to {path}", flush=True)


commit()  # read when the benchmark starts, so a commit made while it runs cannot mislabel its results
