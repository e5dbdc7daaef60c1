"""The end-to-end benchmark scripts run on the CPU with the tiny model (the GPU numbers are in BENCHMARKS.md)."""

import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import benchmarks.common


@pytest.fixture(autouse=True)
def results_dir(tmp_path, monkeypatch):
    """Rows a test records go to a temporary directory, never to benchmarks/results."""
    monkeypatch.setenv(benchmarks.common.RESULTS_DIR_ENV, str(tmp_path / "results"))
    return tmp_path / "results"


@pytest.fixture
def fast_ceilings(monkeypatch):
    # the real ceilings copy 4 GiB and multiply 8K x 8K: minutes on a 2-core CPU, and no floor is checked here
    monkeypatch.setattr(benchmarks.common, "ceilings", lambda: (1e11, 1e12))


def few_timings(monkeypatch, *modules):
    """Timing loops cut to one warm-up and one timed run (in `benchmarks.common` and in each module that imported
    `median_ms` by name), and no profiler trace for a device span: these tests check that a script runs and
    what it prints, not its times, and on this CPU an interpret-mode call takes ~0.1 s and a traced one seconds
    while the trace holds no device events (the span is None either way)."""
    real = benchmarks.common.median_ms

    def median_ms(fn, warmup: int = 3, iters: int = 20, calls: int = 1) -> float:
        return real(fn, warmup=min(warmup, 1), iters=1, calls=calls)

    for module in (benchmarks.common, *modules):
        if hasattr(module, "median_ms"):
            monkeypatch.setattr(module, "median_ms", median_ms)
        if hasattr(module, "fresh_device_ms"):
            monkeypatch.setattr(module, "fresh_device_ms", lambda fn, calls, reps=3: None)


@pytest.mark.slow
def test_e2e_benchmark_runs_on_cpu(fast_ceilings, monkeypatch, capsys):
    from benchmarks import e2e

    argv = ["e2e", "--models", "tiny", "--quant", "none", "--ttft", "64", "--batches", "2", "--context", "40",
            "--no-baseline", "--no-startup", "--no-record"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    e2e.main()
    out = capsys.readouterr().out
    assert "| tiny | none | hybrid-jax | TTFT | 1 | 64 |" in out
    assert "16 steps per executable; 0 compilations in all timed calls" in out  # no recompilation
    assert "experts a layer " in out and "of 8 over the next 16 steps (uniform 3.5)" in out  # 2 rows: counted


@pytest.mark.slow
def test_e2e_startup_rows_alone_and_a_second_start_compiles_nothing(fast_ceilings, monkeypatch, capsys):
    """`--models` with no model: only the start-up rows, two fresh CLI processes sharing a new persistent
    compilation cache; the second loads every executable the first compiled."""
    from benchmarks import e2e

    argv = ["e2e", "--models", "--startup-config", "tiny", "--no-baseline", "--no-record"]
    monkeypatch.setattr(sys, "argv", argv)
    e2e.main()
    out = capsys.readouterr().out
    cold = next(ln for ln in out.splitlines() if ln.startswith("| tiny | none | hybrid-jax CLI | start-up, cold"))
    warm = next(ln for ln in out.splitlines() if ln.startswith("| tiny | none | hybrid-jax CLI | start-up, warm"))
    compiled = int(cold.split("XLA compilations: ")[1].split(",")[0])
    assert compiled > 0
    assert f"XLA compilations: 0, loaded from the persistent cache: {compiled}" in warm
    assert "| hybrid-jax | " not in out  # no model rows


def test_e2e_with_nothing_to_measure_says_so(monkeypatch):
    from benchmarks import e2e

    monkeypatch.setattr(sys, "argv", ["e2e", "--models", "--no-startup", "--no-record"])
    with pytest.raises(SystemExit, match="nothing to measure"):
        e2e.main()


def test_e2e_row_peak_counts_live_bytes_temporaries_and_new_outputs(monkeypatch):
    """A row's peak: the device's live bytes plus the executable's temporaries and outputs, a donated
    input's aliased output not counted twice (a fake device's statistics stand in for the GPU's)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from benchmarks.common import jit_module
    from benchmarks.e2e import _row_peak_gib

    class Device:
        def memory_stats(self):
            return {"bytes_in_use": 1 << 30}

    x = jnp.ones((256, 256), jnp.float32)  # 256 KiB
    fresh = jit_module(lambda m, x: (x @ m.w[...], x + 1), nnx.Dict(w=nnx.Param(jnp.ones((256, 256)))))
    donated = jit_module(lambda m, x: x * m.w[...], nnx.Dict(w=nnx.Param(jnp.ones((256, 256)))), donate_argnums=0)
    monkeypatch.setattr(jax, "devices", lambda *a: [Device()])
    kib = 2**30 / 2**10
    assert (_row_peak_gib(fresh, x) - 1) * kib >= 512  # two new 256 KiB outputs
    assert (_row_peak_gib(donated, x) - 1) * kib < 256  # the output lives in the donated input's buffer
    monkeypatch.setattr(jax, "devices", lambda *a: [type("Cpu", (), {"memory_stats": lambda self: None})()])
    assert _row_peak_gib(fresh, x) is None


def test_e2e_titles_keep_the_recorded_table_names():
    """Runs with and without the transformers-built models file their rows under the tables recorded so far
    (BENCHMARKS.md shows the latest run per table, and goals find their baselines there)."""
    import argparse
    import json

    from benchmarks.common import RESULTS, split_title
    from benchmarks.e2e import add_hf_args, run_title

    p = argparse.ArgumentParser()
    add_hf_args(p)
    recorded = {json.loads(line)["table"] for line in (RESULTS / "e2e.jsonl").read_text().splitlines()}
    kimi = "End to end (Kimi-shaped = 8 layers, 32 experts); decode after 2048 tokens"
    glm5 = "End to end (glm5-shaped = 8 layers, 32 experts); decode after 2048 tokens"
    for models, want in ((["hybrid_small", "kimi"], kimi), (["hybrid_small"], kimi), (["glm5"], glm5)):
        args = argparse.Namespace(**vars(p.parse_args([])), models=models, context=2048, tiny=False)
        table, run = split_title(run_title(args, 3.7e12, 7.5e14))
        assert table == want and want in recorded, (models, table)
        assert run["models"] == ", ".join(models) and run["ceilings"].startswith("HBM 3.70 TB/s")


def test_e2e_floors_count_what_a_step_moves(tiny_model):
    from benchmarks.e2e import decode_floor_bytes, prefill_flops

    cache = tiny_model.init_cache(2, 64)
    one, many = decode_floor_bytes(tiny_model, cache, 1, 32), decode_floor_bytes(tiny_model, cache, 64, 32)
    assert many > one > 0  # more tokens touch more experts and read more cache rows
    assert prefill_flops(tiny_model, 256) > 2 * prefill_flops(tiny_model, 128) > 0  # attention grows faster
    # a verify block: its 5 tokens route like 5 rows' tokens; with no cached rows to read, nothing else differs
    # (each row's KDA state is read and written once either way)
    block = decode_floor_bytes(tiny_model, cache, 1, 0, tokens=5)
    assert block == decode_floor_bytes(tiny_model, cache, 5, 0) > decode_floor_bytes(tiny_model, cache, 1, 0)
    assert decode_floor_bytes(tiny_model, cache, 2, 0, tokens=3) == decode_floor_bytes(tiny_model, cache, 6, 0)
    assert decode_floor_bytes(tiny_model, cache, 1, 32, tokens=1) == one
    with pytest.raises(ValueError, match="tokens=0"):
        decode_floor_bytes(tiny_model, cache, 1, 32, tokens=0)


def test_e2e_floor_takes_the_experts_a_step_touched(tiny_model):
    from benchmarks.e2e import _param_bytes, decode_floor_bytes

    cfg = tiny_model.config
    cache = tiny_model.init_cache(4, 64)
    layers, e, k = cfg.mlp_types.count("moe"), cfg.num_experts, cfg.num_experts_per_tok
    routed = sum(nbytes for nbytes, _ in _param_bytes(tiny_model)[1])
    # one token's k experts are what uniform routing expects of one token
    assert decode_floor_bytes(tiny_model, cache, 1, 32, touched=[k] * layers) == decode_floor_bytes(
        tiny_model, cache, 1, 32
    )
    # 4 rows: all 8 experts read every expert's bytes; rows routed alike read one token's k
    every = decode_floor_bytes(tiny_model, cache, 4, 32, touched=[e] * layers)
    alike = decode_floor_bytes(tiny_model, cache, 4, 32, touched=[k] * layers)
    assert every - alike == pytest.approx(routed * (e - k) / e)
    assert alike < decode_floor_bytes(tiny_model, cache, 4, 32) < every
    # per layer: one layer at e, the rest at k, adds one layer's share (every layer here has the same bytes)
    one = decode_floor_bytes(tiny_model, cache, 4, 32, touched=[e] + [k] * (layers - 1))
    assert one - alike == pytest.approx(routed / layers * (e - k) / e)
    # a multi-token-prediction module is the drafter's: a decode step reads none of it
    from flax import nnx

    from hybrid_jax import HybridLM

    plain = cfg.replace(attn_res_block_size=None)  # MTP takes plain residuals
    with_mtp = HybridLM(plain.replace(mtp_layers=1), rngs=nnx.Rngs(0))
    assert _param_bytes(with_mtp) == _param_bytes(HybridLM(plain, rngs=nnx.Rngs(0)))
    for bad in ([k] * (layers - 1), [0] + [k] * (layers - 1), [3 * k] + [k] * (layers - 1)):
        with pytest.raises(ValueError, match=r"touched=\["):  # one row picks at most k: 3k is no count
            decode_floor_bytes(tiny_model, cache, 1, 32, touched=bad)


def test_count_touched_keeps_the_row_when_the_count_fails(tiny_model):
    """A count that cannot run, or that saw router ids outside the experts (the GPU router's pick for NaN
    scores), falls back to the uniform floor and says why; a good count gives the mean per layer."""
    from benchmarks.e2e import count_touched

    cfg = tiny_model.config
    layers = cfg.mlp_types.count("moe")
    tok, cache = jnp.zeros((2,), jnp.int32), tiny_model.init_cache(2, 16)

    def failing(t, c):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory while compiling")

    got = count_touched(failing, tiny_model, 2, tok, cache)
    assert got[0] is tok and got[1] is cache and got[2] is None
    assert got[3] == "experts not counted (RuntimeError): uniform floor"
    hits = np.full((3, layers), 3, np.int32)
    hits[1, 2] = -1
    got = count_touched(lambda t, c: (t, c, hits), tiny_model, 2, tok, cache)
    assert got[2] is None and got[3] == "experts not counted (router ids outside 0..7, 1x): uniform floor"
    hits[1, 2], hits[0, 0] = 3, 4
    got = count_touched(lambda t, c: (t, c, hits), tiny_model, 2, tok, cache)
    assert got[2] == [10 / 3] + [3.0] * (layers - 1)
    assert (
        got[3] == f"experts a layer {(10 / 3 + 3 * (layers - 1)) / layers:.1f} of 8 over the next 3 steps (uniform 3.5)"
    )
    assert count_touched(failing, tiny_model, 1, tok, cache)[2:] == (None, "")  # one row: k, nothing runs


def test_decode_loop_counts_the_distinct_experts_each_step_chose(tiny_model, monkeypatch):
    """The counting loop decodes what the plain loop decodes, and its counts are the distinct experts the
    step's rows chose in each MoE layer: rows of one prompt choose one token's k; rows of different prompts the
    union that an eager step-by-step run under `record_router` finds."""
    from benchmarks.common import decode_loop
    from hybrid_jax.inspect import record_router
    from hybrid_jax.layers import moe as moe_layer

    cfg = tiny_model.config
    layers, k = cfg.mlp_types.count("moe"), cfg.num_experts_per_tok
    n, b = 3, 4
    plain, count = decode_loop(tiny_model, n), decode_loop(tiny_model, n, count_experts=True)
    prefill = jax.jit(lambda m, ids, c: m.prefill(ids, c, last_only=True))

    def start(ids):
        logits, cache = prefill(tiny_model, ids, tiny_model.init_cache(b, 32))
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

    same = jnp.tile(jax.random.randint(jax.random.key(3), (1, 9), 0, cfg.vocab_size), (b, 1))
    route = moe_layer.moe_route
    tok, cache, hits = count(*start(same))
    assert hits.shape == (n, layers) and (np.asarray(hits) == k).all(), hits

    ids = jax.random.randint(jax.random.key(4), (b, 9), 0, cfg.vocab_size)
    tok0, cache0 = start(ids)
    want_tok, want_cache = plain(tok0, jax.tree.map(jnp.copy, cache0))
    t, c, want_hits = tok0, jax.tree.map(jnp.copy, cache0), []
    for _ in range(n):  # eager: every routing is a concrete array
        with record_router() as routes:
            logits, c = tiny_model.decode_step(t, c)
        t = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        want_hits.append([len(np.unique(r["indices"])) for r in routes])
    tok, cache, hits = count(tok0, cache0)
    np.testing.assert_array_equal(np.asarray(hits), np.array(want_hits))
    assert (np.array(want_hits) > k).any()  # the rows did not all choose alike
    np.testing.assert_array_equal(tok, want_tok)
    np.testing.assert_array_equal(tok, t)
    for got, want in zip(jax.tree.leaves(cache), jax.tree.leaves(want_cache), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    def off_the_end(*a, **kw):  # an id past the experts, as the GPU router picks for NaN scores
        w, idx = route(*a, **kw)
        return w, idx.at[0, 0].set(cfg.num_experts)

    monkeypatch.setattr(moe_layer, "moe_route", off_the_end)
    _, _, hits = decode_loop(tiny_model, 1, count_experts=True)(*start(ids))
    np.testing.assert_array_equal(np.asarray(hits), -np.ones((1, layers), np.int32))
    monkeypatch.setattr(moe_layer, "moe_route", route)
    dense = tiny_model.config.replace(mlp_types=("dense",) * cfg.num_layers)
    from flax import nnx

    from hybrid_jax import HybridLM

    with pytest.raises(ValueError, match="without MoE layers"):
        decode_loop(HybridLM(dense, rngs=nnx.Rngs(0)), 2, count_experts=True)


def test_e2e_decode_floor_reads_one_pooled_key_per_kpool_positions():
    """GLM-5.3-Flash's KPool indexer reads one pooled key per index_kpool (4) positions, a shared indexer layer
    none: 32 more cached positions cost 32 / 4 keys in each of the two layers with their own indexer (2 and 5;
    3 shares), as long as the top-k (8) stays below the context."""
    from flax import nnx

    from benchmarks.e2e import decode_floor_bytes
    from hybrid_jax import HybridLM
    from tests.test_glm5 import glm5_tiny

    model = HybridLM(glm5_tiny(), rngs=nnx.Rngs(0))
    cache = model.init_cache(1, 64)
    key = cache.layers[2].index_k
    key_bytes = model.config.index_head_dim * key.values.dtype.itemsize + (
        0 if key.scales is None else key.scales[0, 0].nbytes
    )
    grown = decode_floor_bytes(model, cache, 1, 64) - decode_floor_bytes(model, cache, 1, 32)
    assert cache.layers[3].index_k is None and grown == 2 * (32 // 4) * key_bytes


@pytest.mark.slow
def test_stage_breakdown_runs_on_cpu(monkeypatch, capsys):
    from benchmarks import e2e_stages

    argv = ["e2e_stages", "--model", "tiny", "--prefill", "64", "--decode-batch", "2", "--context", "40",
            "--iters", "1", "--no-record"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    e2e_stages.main()
    out = capsys.readouterr().out
    for stage in ("KDA mixer", "sparse MLA + indexer mixer", "MoE FFN", "Pallas grouped matmul", "full call"):
        assert stage in out, stage


def test_kernel_count_reads_compiled_hlo():
    import jax
    import jax.numpy as jnp

    from benchmarks.kernel_count import count_kernels

    def loop(x):  # a matmul, then a loop whose body holds one more
        y = jnp.sin(x) @ x.T
        return jax.lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c @ c) + i, y)

    x = jnp.ones((32, 32))
    straight = count_kernels(jax.jit(lambda x: jnp.sin(x) @ x.T).lower(x).compile().as_text())
    looped = count_kernels(jax.jit(loop).lower(x).compile().as_text())
    assert sum(straight.values()) >= 1
    assert sum(looped.values()) > sum(straight.values())  # the loop body's kernels are counted too
    assert not {"parameter", "constant", "tuple", "get-tuple-element"} & set(looped)


def test_chained_device_time_is_the_traced_span_per_call(monkeypatch):
    """`chained_device_ms`: one execution's first kernel start to last kernel end over the chain's calls
    (median of the traced executions); None where the trace has no device events (this CPU)."""
    import jax.numpy as jnp

    from benchmarks import common

    x = jnp.arange(8.0)
    assert common.chained_device_ms(jnp.sin, x, n=2, reps=1) is None
    spans = iter([[(10.0, 2.0, "a"), (13.0, 5.0, "b")], [(0.0, 1.0, "a"), (2.0, 2.0, "b")], [(5.0, 9.0, "a")]])
    monkeypatch.setattr(common, "device_events", lambda _: next(spans))
    # spans 8, 4 and 9 us over 2 calls: 4, 2, 4.5 us a call, median 4 us
    assert common.chained_device_ms(jnp.sin, x, n=2, reps=3) == pytest.approx(0.004)


def test_dispatched_kernel_time_sums_the_kernels_per_call(monkeypatch):
    """`dispatched_kernel_ms`: the device events' summed durations over the calls (gaps and the host's
    dispatch left out), median of the traced runs; None where the trace has no device events (this CPU)."""
    import jax.numpy as jnp

    from benchmarks import common

    x = jnp.arange(8.0)
    assert common.dispatched_kernel_ms(jnp.sin, x, calls=2, reps=1) is None
    runs = iter([[(10.0, 2.0, "a"), (13.0, 5.0, "b")], [(0.0, 1.0, "a"), (50.0, 2.0, "b")], [(5.0, 9.0, "a")]])
    monkeypatch.setattr(common, "device_events", lambda _: next(runs))
    # 7, 3 and 9 us of kernels over 2 calls: 3.5, 1.5, 4.5 us a call, median 3.5 us (the 48 us gap not counted)
    assert common.dispatched_kernel_ms(jnp.sin, x, calls=2, reps=3) == pytest.approx(0.0035)


def test_profile_stage_parses_device_kernels_and_writes_hlo(tmp_path, monkeypatch, capsys):
    import gzip
    import json

    from benchmarks import profile_stage

    trace = tmp_path / "trace" / "plugins" / "profile" / "run"
    trace.mkdir(parents=True)
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 1, "name": "fusion_1", "dur": 3.0},
        {"ph": "X", "pid": 1, "name": "fusion_1", "dur": 5.0},
        {"ph": "X", "pid": 1, "name": "kda_decode_step", "dur": 2.5},
        {"ph": "X", "pid": 2, "name": "host work", "dur": 100.0},  # not a device kernel
    ]
    (trace / "perfetto_trace.json.gz").write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    times = profile_stage.kernel_times(tmp_path / "trace")
    assert dict(times) == {"fusion_1": [3.0, 5.0], "kda_decode_step": [2.5]}
    # by start (these events have none: 0), host events left out
    assert benchmarks.common.device_events(tmp_path / "trace") == [
        (0.0, 2.5, "kda_decode_step"),
        (0.0, 3.0, "fusion_1"),
        (0.0, 5.0, "fusion_1"),
    ]
    # traced into again: the newest trace is read, whichever of the two is newer (not the first found)
    import os

    again = tmp_path / "trace" / "plugins" / "profile" / "another"
    again.mkdir()
    (again / "perfetto_trace.json.gz").write_bytes(gzip.compress(json.dumps(events[:2] + events[4:5]).encode()))
    now = (trace / "perfetto_trace.json.gz").stat().st_mtime_ns
    for newer, want in (
        (again, {"kda_decode_step": [2.5]}),
        (trace, {"fusion_1": [3.0, 5.0], "kda_decode_step": [2.5]}),
    ):
        now += 10**9
        os.utime(newer / "perfetto_trace.json.gz", ns=(now, now))
        assert dict(profile_stage.kernel_times(tmp_path / "trace")) == want
    with pytest.raises(FileNotFoundError, match="no perfetto_trace.json.gz under"):
        benchmarks.common.device_events(tmp_path / "out")
    # the CPU has no device events to list, but the stage compiles, runs under the profiler and leaves its HLO
    argv = ["profile_stage", "--model", "tiny", "--stage", "kda", "--batch", "1", "--context", "16", "--calls", "2",
            "--out", str(tmp_path / "out"), "--quant", "hierarchical"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    from benchmarks import e2e

    asked, build = [], e2e.build_model
    # --quant reaches the model builder (the tiny preset itself is too narrow for the FP8 cache's tiles)
    monkeypatch.setattr(e2e, "build_model", lambda name, quant="none", **kw: asked.append(quant) or build(name, **kw))
    profile_stage.main()
    assert asked == ["hierarchical"]
    assert "while" in (tmp_path / "out" / "kda_b1.hlo.txt").read_text()
    assert "kda stage (layer 0), B=1" in capsys.readouterr().out
    # the whole step reads a cache filled with random values, --context positions long
    from benchmarks import long_context

    filled, fill = [], long_context._random_like

    def recorded(cache, key):  # the step donates the cache: its values are read here
        cache = fill(cache, key)
        filled.append(float(abs(cache.layers[0].recurrent).max()))
        return cache

    monkeypatch.setattr(long_context, "_random_like", recorded)
    monkeypatch.setattr(sys, "argv", [*argv[:4], "step", *argv[5:-2]])
    profile_stage.main()
    out = capsys.readouterr().out
    assert "step stage (layer 0), B=1" in out and len(filled) == 1 and filled[0] > 0
    # a verify step of --num-draft + 1 tokens runs over the same filled cache and commits one of them
    monkeypatch.setattr(sys, "argv", [*argv[:4], "verify", *argv[5:-2], "--num-draft", "3"])
    profile_stage.main()
    out = capsys.readouterr().out
    assert "verify stage (layer 0), B=1" in out and len(filled) == 2
    hlo = (tmp_path / "out" / "verify_b1.hlo.txt").read_text()
    assert "s32[1,4]" in hlo and "s32[1,4]" not in (tmp_path / "out" / "step_b1.hlo.txt").read_text()  # the block


def test_profile_stage_compares_a_chunked_prefill_with_one_call(tmp_path, monkeypatch, capsys):
    """--stage prefill --prefill-chunk: a cut preset, both prefills compiled, run and traced, the comparison
    printed (the CPU has no device kernels to fill it)."""
    from benchmarks import profile_stage

    argv = ["profile_stage", "--model", "tiny", "--layers", "2", "--experts", "4", "--stage", "prefill", "--tokens",
            "48", "--prefill-chunk", "16", "--calls", "1", "--out", str(tmp_path)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    profile_stage.main()
    assert "while" in (tmp_path / "prefill_48_chunk16.hlo.txt").read_text()  # the chunk loop
    assert (tmp_path / "prefill_48.hlo.txt").exists()
    out = capsys.readouterr().out
    assert "prefill T=48, B=1, one call" in out and "chunks of 16 minus one call, per source" in out


def test_profile_stage_indexer_runs_each_selection(tmp_path, monkeypatch, capsys):
    """`--stage indexer` profiles the decode Top-K once per selection (on the CPU the kernels run in interpret
    mode and the trace has no device kernels to list, but the selection compiles, runs, is titled and traced)."""
    from benchmarks import profile_stage

    argv = ["profile_stage", "--stage", "indexer", "--batch", "1", "--context", "256", "--topk", "16",
            "--selects", "split", "--calls", "1", "--out", str(tmp_path)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    profile_stage.main()
    out = capsys.readouterr().out
    assert "indexer decode B=1 S=256 64x128 top-16, select=split, unsorted" in out
    assert [p.name for p in tmp_path.iterdir()] == ["trace_indexer_split_b1"]


def test_profile_stage_maps_xla_kernels_to_their_source_lines(capsys):
    from pathlib import Path

    from benchmarks import profile_stage

    root = str(Path(profile_stage.__file__).resolve().parents[1])
    hlo = "\n".join([
        "HloModule jit_run, is_scheduled=true",
        "",
        "FileNames",
        '1 "/usr/lib/python3.12/site-packages/jax/_src/numpy/lax_numpy.py"',
        f'2 "{root}/hybrid_jax/layers/kda.py"',
        "",
        "FunctionNames",
        '1 "pad"',
        '2 "KimiDeltaAttention.__call__"',
        "",
        "FileLocations",
        "1 {file_name_id=1 function_name_id=1 line=10 end_line=10 column=1 end_column=2}",
        "2 {file_name_id=2 function_name_id=2 line=229 end_line=229 column=1 end_column=2}",
        "",
        "StackFrames",
        "1 {file_location_id=2 parent_frame_id=1}",
        "2 {file_location_id=1 parent_frame_id=1}",
        "",
        "%fused_pad (p: f32[4]) -> f32[8] {",
        '  %loop_pad_fusion.7 = f32[8]{0} fusion(%p), kind=kLoop, metadata={op_name="jit(run)/pad" '
        'deduplicated_name="loop_pad_fusion.3" stack_frame_id=2}',
        "}",
    ])  # fmt: skip
    src = profile_stage.hlo_sources(hlo)
    # the innermost frame inside the repository (frame 2 is jax's own, its parent frame 1 is kda.py)
    assert (
        src["loop_pad_fusion_7"]
        == src["loop_pad_fusion_3"]
        == "hybrid_jax/layers/kda.py:229 (KimiDeltaAttention.__call__)"
    )
    profile_stage.print_table("t", {"loop_pad_fusion_3": [4.0], "my_kernel": [2.0]}, 1, 5, src)
    out = capsys.readouterr().out
    assert (
        "| loop_pad_fusion_3 | 1 | 4.0 | 67% | hybrid_jax/layers/kda.py:229" in out
        and "| my_kernel | 1 | 2.0 | 33% |  |" in out
    )


def test_ceilings_take_the_best_of_their_repeats(monkeypatch):
    """Each ceiling is the best of `repeats` medians (the warm-up timings not counted); the bandwidth is the
    better of the copy's rate (2 bytes moved per byte of input) and the two sums' (1 byte read)."""

    def run(copy, row_sum, scalar_sum, matmul, warmup=9.0):
        timed = iter([warmup, *copy, warmup, *row_sum, warmup, *scalar_sum, warmup, *matmul])  # warm-up, 3 medians
        monkeypatch.setattr(benchmarks.common, "median_ms", lambda fn, **kw: (fn(), next(timed))[1])
        return benchmarks.common.ceilings(repeats=3, copy_elems=1024, mm=16)

    nbytes = 1024 * 4
    bw, rate = run([2.0, 1.0, 4.0], [8.0, 3.0, 5.0], [6.0, 7.0, 9.0], [8.0, 0.5, 2.0])
    assert bw == 2 * nbytes / 1e-3  # the copy's 1.0 ms median: 2x the sums' best
    assert rate == 2 * 16**3 / 0.5e-3
    bw, _ = run([2.0, 1.0, 4.0], [8.0, 0.4, 5.0], [6.0, 0.25, 9.0], [1.0, 1.0, 1.0])
    assert bw == nbytes / 0.25e-3  # a read alone went faster than the copy
    bw, _ = run([2.0, 1.0, 4.0], [0.4, 3.0, 5.0], [6.0, 7.0, 9.0], [1.0, 1.0, 1.0])
    assert bw == nbytes / 0.4e-3
    bw, rate = run([2.0, 1.0, 4.0], [8.0, 3.0, 5.0], [6.0, 7.0, 9.0], [8.0, 0.5, 2.0], warmup=0.01)
    assert (bw, rate) == (2 * nbytes / 1e-3, 2 * 16**3 / 0.5e-3)  # a fast warm-up counts in no ceiling


def test_gpu_parity_cuts_each_preset_to_a_valid_config_with_every_layer_kind():
    """The parity benchmark's cut keeps the widths and one layer of each attention and MLP type (DeepSeek's
    first MoE layer is its fourth, Kimi's first MLA layer too) and a valid expert grouping."""
    from benchmarks.gpu_parity import cut_config
    from hybrid_jax import PRESETS

    for name, preset in PRESETS.items():
        full, cut = preset(), cut_config(preset(), 2, 16)
        assert set(cut.layer_types) == set(full.layer_types) and set(cut.mlp_types) == set(full.mlp_types), name
        assert (cut.hidden_size, cut.num_heads, cut.index_num_heads) == (full.hidden_size, full.num_heads,
                                                                          full.index_num_heads)  # fmt: skip
        assert cut.num_experts == min(16, full.num_experts) and cut.num_layers <= 4, name
    ds = cut_config(PRESETS["deepseek_v32"](), 2, 16)
    assert ds.layer_types == ("sparse",) * 3 and ds.mlp_types == ("dense", "dense", "moe")
    assert (ds.n_group, ds.topk_group, ds.num_experts_per_tok) == (8, 4, 8)


def test_kernel_resources_flags_a_tile_past_the_shared_memory(tmp_path):
    """The MoE prefill tiles with float32 operands, compiled on the host for sm_90 by the `triton` package: 3
    stages over the limit (the H200 refused them), the 2 the defaults now take under it."""
    pytest.importorskip("triton")
    import jax
    import jax.numpy as jnp

    from benchmarks.kernel_resources import SMEM_LIMIT, compile_for_hopper, triton_kernels
    from pallas_kernels.moe import moe_experts

    x, w = jax.ShapeDtypeStruct((512, 256), jnp.float32), jax.ShapeDtypeStruct((512, 2), jnp.float32)
    idx = jax.ShapeDtypeStruct((512, 2), jnp.int32)
    gate, down = jax.ShapeDtypeStruct((8, 256, 128), jnp.float32), jax.ShapeDtypeStruct((8, 128, 256), jnp.float32)

    def smem(**kw):
        run = lambda *a: moe_experts(*a, impl="pallas", interpret=False, block_m=128, **kw)  # noqa: E731
        kernels = {k["name"]: k for k in triton_kernels(run, x, idx, w, gate, gate, down)}
        return compile_for_hopper(kernels["moe_gate_up"], tmp_path)

    three, default = smem(num_stages=3), smem()
    assert three["smem"] > SMEM_LIMIT >= default["smem"] > 0 and default["regs"] > 0


def test_sparse_mla_bound_mosaic_rows_refuse_a_machine_without_sm90(monkeypatch, capsys):
    """`--mosaic` off an sm_90 GPU: a one-line usage error naming the device, before anything is timed."""
    from benchmarks import sparse_mla_bound as smb
    from pallas_kernels import registry

    if registry.is_sm90():
        pytest.skip("runs the Mosaic rows on an sm_90 GPU")
    monkeypatch.setattr(sys, "argv", ["sparse_mla_bound", "--mosaic", "--no-record"])
    with pytest.raises(SystemExit) as exit_info:
        smb.main()
    assert exit_info.value.code == 2
    assert "--mosaic times the Mosaic GPU kernel, which needs an sm_90 GPU (found" in capsys.readouterr().err


def test_sparse_mla_bound_probes_compute_what_they_claim():
    """The decode-bound probes (interpret mode, small shapes at the real widths): the transposed loop is
    attention (it matches the library kernel); the gather-only and products-only loops run and stay finite;
    every timed case lowers for the H200 (no GPU needed)."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import sparse_mla_bound as smb
    from benchmarks.kernel_resources import triton_kernels
    from pallas_kernels.sparse_attention.kernel import sparse_mla_pallas

    ql, qr, kv, sets = smb.inputs(jax.random.key(1), b=2, heads=32, topk=64, rows_per_query=128, shared_rows=256)
    slots = sets["own rows, sorted"]
    ql, qr = ql.astype(jnp.float32), qr.astype(jnp.float32)
    want, _ = sparse_mla_pallas(
        ql, qr, slots, kv, scale=smb.SCALE, block_h=16, block_k=32, precision="bf16", interpret=True
    )
    got = smb.probe(ql, qr, slots, kv, mode="transposed", block_h=16, block_k=32, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-2, atol=2e-2)
    for mode in ("gather", "products"):
        out = smb.probe(ql, qr, sets["shared rows (L2)"], kv, mode=mode, block_h=16, block_k=32, interpret=True)
        assert np.isfinite(np.asarray(out)).all()
    shapes = [
        jax.ShapeDtypeStruct(s, d)
        for s, d in (
            ((smb.B, smb.HEADS, smb.LAT), jnp.bfloat16),
            ((smb.B, smb.HEADS, smb.ROPE), jnp.bfloat16),
            ((smb.B, smb.TOPK), jnp.int32),
            ((smb.B * smb.ROWS_PER_QUERY, smb.LAT + smb.ROPE), jnp.bfloat16),
        )
    ]
    for _, mode, bh, bk, nw, ns, _ in smb.CASES:
        if mode != "full":
            fn = functools.partial(smb.probe, mode=mode, block_h=bh, block_k=bk, num_warps=nw, num_stages=ns)
            assert [k["name"] for k in triton_kernels(fn, *shapes)] == [f"sparse_mla_probe_{mode}"]


@pytest.mark.slow
def test_sparse_attention_benchmark_runs_on_cpu(fast_ceilings, monkeypatch, capsys):
    """The issue-6 benchmark end to end at toy sizes in interpret mode: indexer decode rows on fresh inputs (the
    default selection against the jnp reference, the selections alone), sparse MLA decode rows as separate
    dispatches (defaults, the queries-inner grid, one explicit tile, FP8 rows), the Top-K alone on two rows of
    one `--topk-kinds` kind. The default tile and its queries-inner grid are made to fail: each leaves a "did not
    run" row and the rows after them still run; nothing else fails."""
    from benchmarks import sparse_attention

    # the script took `ceilings` by name: patch its own reference too (the real ones take minutes here)
    monkeypatch.setattr(sparse_attention, "ceilings", benchmarks.common.ceilings)
    few_timings(monkeypatch, sparse_attention)
    # a GPU's profiler trace gives the kernels' time of each decode row; none here, so a stand-in shows the plumbing
    monkeypatch.setattr(sparse_attention, "_kernel_note", lambda fn, *a, calls: f"; kernels {calls}.000 ms a call")
    real_err = sparse_attention._err_if_runs

    def failing(fn, args, ref, what):  # a stand-in for a tile the GPU refuses (e.g. past its shared memory)
        if what.split(" | ")[-1].startswith("pallas, defaults ("):
            print(f"  {what}: did not run: stand-in failure", flush=True)
            return None
        return real_err(fn, args, ref, what)

    monkeypatch.setattr(sparse_attention, "_err_if_runs", failing)
    argv = ["sparse_attention", "--contexts", "2048", "--batches", "1", "--index-heads", "16", "--index-dim", "32",
            "--topk", "256", "--indexer-prefill", "0", "--mla-batch", "2", "--mla-heads", "16", "--mla-context", "512",
            "--mla-prefill", "0", "--mla-decode-variants", "16:32:bf16:-:4:2", "--decode-selects", "default",
            "--chain", "2", "--fresh-calls", "2", "--topk-kinds", "relu_zeros", "--topk-rows", "2",
            "--no-record"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    sparse_attention.main()
    out = capsys.readouterr().out
    assert "| indexer | decode B=1 S=2048 heads=16x32 top-256, 2 calls, fresh inputs | jnp reference" in out
    assert "split selection alone on [B, S]" in out and "Top-K overlap 1.0000" in out
    # a row whose K-th value is a zero shared by most of it: more than 2k candidates, cut inside the ranking
    top = [ln for ln in out.splitlines() if ln.startswith("| top-k | [2, 2048] relu_zeros scores")]
    assert len(top) == 4 and "split selection, best first (the default) | " in top[3], top
    assert "equal to lax.top_k" in top[3] and all("Top-K overlap 1.0000" in ln for ln in top[1:3]), top
    mla = [ln for ln in out.splitlines() if ln.startswith("| sparse MLA decode | B=2 T=1 heads=16")]
    assert all("2 separate dispatches" in ln for ln in mla), mla
    failed = [ln for ln in mla if "did not run (see log)" in ln]
    assert len(failed) == 2 and all(" | pallas, defaults (16 heads" in ln for ln in failed), mla
    assert "queries-inner grid" in failed[1], failed  # tried, and recorded, after the default failed
    ran = [ln for ln in mla if ln not in failed and "jnp reference" not in ln]
    assert any("block_h=16, block_k=32" in ln for ln in ran) and any("FP8 latent pool" in ln for ln in ran), mla
    # every kernel row that ran carries its kernels' time beside its wall time
    assert all("rel err" in ln and "; kernels 2.000 ms a call" in ln for ln in ran), ran
    assert all("pallas, defaults (16 heads" in ln for ln in out.splitlines() if "did not run" in ln), out


def test_sparse_mla_floors_count_the_rows_a_call_reads():
    """An early causal query selects fewer than top-k rows (no FLOPs for the rest); a decode call reads its
    selected rows, a prefill call each pool row once however many queries select it."""
    import jax.numpy as jnp

    from benchmarks.sparse_attention import _mla_work

    heads, lat, rope, rb = 4, 8, 2, 20
    pos = jnp.arange(6)[None, :, None]
    idx = jnp.where(jnp.arange(4)[None, None, :] <= pos, pos - jnp.arange(4), -1)  # [1, 6, 4] causal top-4
    flops, nbytes = _mla_work(idx, heads, lat, rope, 6, rb)
    selected = 1 + 2 + 3 + 4 + 4 + 4
    io = 6 * heads * (2 * lat + rope) * 2
    assert flops == 2 * heads * (2 * lat + rope) * selected and nbytes == io + 6 * rb
    flops, nbytes = _mla_work(idx[:, -1:], heads, lat, rope, 6, rb)  # one decode query: its 4 rows
    assert flops == 2 * heads * (2 * lat + rope) * 4 and nbytes == heads * (2 * lat + rope) * 2 + 4 * rb


def test_fresh_inputs_run_every_call_in_order(monkeypatch):
    """`fresh_program`: every call in the one program, each on its own inputs (outputs equal fn's), chained by
    optimization barriers (n - 1 of them, each taking the previous call's output), none merged or dropped in the
    compiled program; `fresh_device_ms` is the traced span over the calls (None on this CPU)."""
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import common

    fn = lambda x: (jnp.sin(x) * 3.0, x[0])  # noqa: E731
    calls = [(jnp.full((8,), float(i)),) for i in range(3)]
    program = common.fresh_program(fn, 3)
    outs = program(calls)
    for (x,), (got, first) in zip(calls, outs, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.sin(x) * 3.0))
        assert float(first) == float(x[0])
    assert program.lower(calls).as_text().count("stablehlo.optimization_barrier") == 2
    hlo = program.lower(calls).compile().as_text()
    assert hlo.count("sine(") == 3, hlo  # one per call, none shared
    assert common.fresh_ms(fn, calls, warmup=0, iters=2) > 0
    with pytest.raises(ValueError, match="3 argument tuples for a program of n=2"):
        common.fresh_program(fn, 2)(calls)
    assert common.fresh_device_ms(fn, calls, reps=1) is None
    spans = iter([[(0.0, 3.0, "a"), (4.0, 2.0, "b")]])
    monkeypatch.setattr(common, "device_events", lambda _: next(spans))
    assert common.fresh_device_ms(fn, calls, reps=1) == pytest.approx(0.002)  # 6 us over 3 calls


def _records(date, *rows, commit="abc1234"):
    """Records of one run as `append_results` writes them: rows (shape, impl, median ms[, % of floor])."""
    rows = [{"case": "c", "shape": r[0], "impl": r[1], "median ms": r[2], "% of floor": (r[3:] or [""])[0]}
            for r in rows]  # fmt: skip
    return benchmarks.common.result_rows("s.py", "T", rows, date=date, commit=commit, device="gpu:X x1", jax="0")


def _record(date, impl, ms, shape="B=1", commit="abc1234"):
    return _records(date, (shape, impl, ms), commit=commit)[0]


def test_report_appends_rows_to_jsonl_in_the_results_dir(results_dir, capsys):
    """`report` prints the table and appends one record per row: the run's fields, the table without its measured
    ceilings, the columns as text, the identity, the main value and the same-shape reference as baseline."""
    import json
    import re

    import jax

    from benchmarks.common import ROOT, report

    title = "Toy kernels; ceilings measured in this run: HBM 3.00 TB/s, bf16 matmul 600 TFLOP/s"
    rows = [
        {"case": "toy", "shape": "B=4", "impl": "jnp reference", "median ms": "2.000", "% of floor": "10%"},
        {"case": "toy", "shape": "B=4", "impl": "pallas", "median ms": "0.500", "% of floor": "40%"},
        {"case": "toy", "shape": "B=8", "impl": "pallas", "median ms": "1,250.5", "% of floor": "41%"},
    ]
    report("toy_bench.py", title, rows)
    report("toy_bench.py", title, rows[:1])
    assert "| toy | B=4 | pallas | 0.500 | 40% |" in capsys.readouterr().out
    assert not (ROOT / "benchmarks" / "results" / "toy_bench.jsonl").exists()
    recs = [json.loads(line) for line in (results_dir / "toy_bench.jsonl").read_text().splitlines()]
    assert len(recs) == 4
    ref, pallas, wide, again = recs
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", ref["date"])
    assert ref["commit"] == benchmarks.common.commit() and ref["jax"] == jax.__version__
    assert ref["device"].startswith("cpu:") and ref["script"] == "toy_bench.py"
    assert ref["table"] == "Toy kernels" and ref["run"] == {"ceilings": "HBM 3.00 TB/s, bf16 matmul 600 TFLOP/s"}
    assert ref["identity"] == ["case", "shape", "impl"] and ref["columns"] == rows[0]
    assert (ref["metric"], ref["value"], ref["unit"]) == ("median ms", 2.0, "ms") and "baseline" not in ref
    assert pallas["baseline"] == {"impl": "jnp reference", "value": 2.0, "unit": "ms"}
    assert wide["value"] == 1250.5 and "baseline" not in wide  # no reference of that shape
    assert benchmarks.common.row_key(again) == benchmarks.common.row_key(ref) != benchmarks.common.row_key(pallas)


def test_report_picks_the_latest_row_per_key_and_the_latest_run_per_shape():
    """Of two rows with one key the newer wins (and of one date the later in the files); a shape shows its
    latest run's rows only (an implementation that run did not time drops out); how a decode row was timed
    ("10 chained calls", "40 calls, fresh inputs", "10 separate dispatches") is no shape of its own; a shape no
    newer run measured stays."""
    from benchmarks.report import current, latest

    rows = [
        _record("2026-12-02T00:00:00Z", "pallas", "1.0", commit="new"),
        _record("2026-12-01T00:00:00Z", "pallas", "2.0", commit="old"),
        _record("2026-12-01T00:00:00Z", "triton", "3.0", commit="old"),
        _record("2026-12-01T00:00:00Z", "pallas", "5.0", shape="B=2", commit="old"),
        _record("2026-12-03T00:00:00Z", "pallas", "0.9", shape="B=2, 10 chained calls", commit="newest"),
        _record("2026-11-30T00:00:00Z", "pallas", "4.0", shape="B=64", commit="oldest"),
        _record("2026-11-29T00:00:00Z", "pallas", "4.5", shape="B=8, 10 separate dispatches", commit="oldest"),
        _record("2026-12-04T00:00:00Z", "pallas", "3.0", shape="B=8, 40 chained calls", commit="fresh"),
        _record(
            "2026-12-05T00:00:00Z",
            "pallas",
            "3.5",
            shape="B=8, 40 calls, fresh inputs (one shared key pool)",
            commit="fresh",
        ),  # fmt: skip
    ]
    for i, r in enumerate(rows):
        r["_order"] = i
    newest = latest(rows)
    assert [newest[benchmarks.common.row_key(r)]["commit"] for r in rows[:3]] == ["new", "new", "old"]
    tie = [dict(rows[1], _order=0), dict(rows[1], commit="later", _order=1)]
    assert [r["commit"] for r in latest(tie).values()] == ["later"]
    shown = current(rows)[("s.py", "T")]
    assert [(r["columns"]["shape"], r["columns"]["impl"], r["commit"]) for r in shown] == [
        ("B=1", "pallas", "new"),  # not the older triton row of that shape
        ("B=2, 10 chained calls", "pallas", "newest"),
        ("B=64", "pallas", "oldest"),
        ("B=8, 40 calls, fresh inputs (one shared key pool)", "pallas", "fresh"),
    ]


def test_goals_are_met_missed_or_not_measured():
    from benchmarks.report import goal_row

    rows = _records(
        "2026-12-01T00:00:00Z",
        ("B=1", "jnp reference", "10.0"),
        ("B=1", "pallas", "1.0", "80%"),
        ("B=2", "jnp reference", "10.0"),
        ("B=2", "pallas", "4.0", "20%"),
    )
    rows += _records("2026-11-01T00:00:00Z", ("B=2", "jnp reference", "10.0"), ("B=2", "pallas", "0.5"))  # older
    for i, r in enumerate(rows):
        r["_order"] = i
    sel = [{"label": f"B={b}", "match": {"shape": f"^B={b}$", "impl": "^pallas"}} for b in (1, 2)]
    goal = {"issue": 1, "goal": "g", "script": "s.py", "measure": "speedup", "target": 5, "unit": "x", "rows": sel}
    row = goal_row(goal, rows)
    assert row[3] == "B=1: 10.00x (1 vs 10 ms); B=2: 2.50x (4 vs 10 ms)" and row[5] == "met: B=1; missed: B=2"
    assert goal_row(dict(goal, rows=sel[:1]), rows)[5] == "met"
    assert goal_row(dict(goal, measure="% of floor", target=50, rows=sel[1:]), rows)[5] == "missed"
    assert goal_row(dict(goal, rows=[{"label": "x", "match": {"shape": "^B=9$"}}]), rows)[5] == "not measured"
    assert goal_row(dict(goal, script="other.py"), rows)[3] == "B=1: not measured; B=2: not measured"
    # the device span from the check column: B=1's 1 ms wall was 0.5 ms on the device (80% -> 160% of floor)
    rows[1]["columns"]["check vs reference"] = "Top-K overlap 1.0000; device 0.5 ms/call"
    device = dict(goal, measure="device ms", target=0.6, at_most=True, rows=sel)
    assert goal_row(device, rows)[3] == "B=1: 0.5 ms on the device (1 ms wall); B=2: not measured"
    assert goal_row(dict(device, rows=sel[:1]), rows)[5] == "met"
    pct = goal_row(dict(goal, measure="device % of floor", target=100, rows=sel[:1]), rows)
    assert pct[3] == "B=1: 160% (0.5 ms on the device, 1 wall)" and pct[5] == "met"


def test_benchmarks_md_is_what_the_committed_rows_make():
    """BENCHMARKS.md is generated: from the committed JSONL and goals the same text twice, at most 60 KB, equal
    to the file (`python -m benchmarks.report` rewrites it after a run)."""
    from benchmarks.report import MAX_BYTES, OUTPUT, load, load_goals, main, render

    records, goals = load(), load_goals()
    text = render(records, goals)
    assert text == render(load(), load_goals())
    assert len(text.encode()) <= MAX_BYTES
    assert OUTPUT.read_text() == text, "BENCHMARKS.md is stale: run python -m benchmarks.report"
    assert main(["--check"]) == 0
    assert "| status |" in text.split("## `benchmarks/")[0]  # the goals table comes first


def test_report_check_fails_on_a_stale_file_and_merge_adds_only_new_rows(tmp_path, results_dir):
    import json

    from benchmarks.report import main, merge

    results_dir.mkdir()
    old = json.dumps(_record("2026-12-01T00:00:00Z", "pallas", "1.0"))
    new = json.dumps(_record("2026-12-02T00:00:00Z", "pallas", "0.5"))
    (results_dir / "s.jsonl").write_text(old + "\n")
    gpu = tmp_path / "gpu"
    gpu.mkdir()
    (gpu / "s.jsonl").write_text(old + "\n" + new + "\n")  # the device's copy: ours plus its run
    out = tmp_path / "B.md"
    args = ["--results", str(results_dir), "--output", str(out)]
    assert main(args) == 0 and main([*args, "--check"]) == 0
    assert merge(gpu, results_dir) == 1 and merge(gpu, results_dir) == 0
    assert main([*args, "--check"]) == 1  # a new row: the file is stale
    assert main(args) == 0 and "| 0.5 |" in out.read_text() and "| 1.0 |" not in out.read_text()


@pytest.mark.slow
def test_long_context_benchmark_runs_on_cpu(fast_ceilings, monkeypatch, capsys):
    """The issue-42 benchmark at toy size: a 96-token prompt in 32-token chunks with TTFT and decode rows after
    40 and 96 tokens, then 1- and 2-row decodes on a random-filled 48-token cache."""
    from benchmarks import long_context

    # --layers 2: tiny cut to its first two layers plus the first of each kind they lack (4 layers, as
    # gpu_parity.cut_config does: KDA, KDA, sparse, full; dense MLP then three MoE layers)
    argv = ["long_context", "--preset", "tiny", "--layers", "2", "--lengths", "40", "96", "--chunk", "32",
            "--batches", "1", "2", "--batch-contexts", "48", "--no-record"]  # fmt: skip
    monkeypatch.setattr("sys.argv", argv)
    long_context.main()
    out = capsys.readouterr().out
    assert "Long context on one device (tiny, 4 layers, " in out
    for case, batch, tokens in [("TTFT (chunked prefill)", 1, 40), ("decode step (after the prefill)", 1, 96),
                                ("decode step (random-filled cache)", 1, 48),
                                ("decode step (random-filled cache)", 2, 48)]:  # fmt: skip
        assert f"case={case} | batch={batch} | tokens={tokens} | ms=" in out, out[-3000:]
    monkeypatch.setattr("sys.argv", ["long_context", "--preset", "tiny", "--layers", "0"])
    with pytest.raises(SystemExit, match="--layers must be >= 1, got 0"):
        long_context.main()
    # the 2-row floor counts the experts its steps chose; one row's k experts need no count
    rows = [ln for ln in out.splitlines() if ln.startswith("  case=decode step (random-filled cache)")]
    assert ["experts a layer " in ln for ln in rows] == [False, True], rows
    assert "of 8 over the next 16 steps (uniform 3.5)" in rows[1], rows


@pytest.mark.slow
def test_speculative_benchmark_runs_on_cpu(monkeypatch, capsys):
    """The speculative benchmark at toy size: plain and speculative rows (the replay of plain greedy's tokens
    emits k + 1 tokens a step in float32, where verify and decode agree), the verify and decode steps; with
    --mtp the MTP drafter's row and its drafting call."""
    from benchmarks import speculative

    # --layers 2: tiny cut to 4 layers (the first KDA pair + the first sparse and full MLA layers: every kind)
    argv = ["speculative", "--preset", "tiny", "--layers", "2", "--batches", "2", "--context", "40", "--new", "11",
            "--num-draft", "2", "--wrong-every", "--reps", "1", "--steps", "2", "--dtype", "float32", "--mtp",
            "--no-record"]  # fmt: skip
    monkeypatch.setattr("sys.argv", argv)
    speculative.main()
    out = capsys.readouterr().out
    assert "| 2 | 40 | plain greedy |  |  |" in out
    assert "| 2 | 40 | speculative k=2 | replay of plain greedy | 2.50 |" in out  # 10 tokens after the first: 3+3+3+1
    assert out.count("| same tokens as plain greedy |") == 3, out[-2000:]  # ngram, replay, mtp
    assert "| speculative k=2 | mtp (random weights) |" in out and "| mtp drafting call, 2 drafts |" in out
    assert "verify step, 3 tokens + commit" in out and "x a decode step; byte floor " in out
    assert "| vs plain at byte floors |" in out
    # the replay's bound: its 2.50 tokens a step over the verify step's byte floor in decode steps' (> 1: its
    # 3 tokens a row route to more experts than one)
    ratio = float(re.search(r"byte floor ([0-9.]+)x a decode step's", out).group(1))
    bound = re.search(r"\| replay of plain greedy \| 2\.50 \|[^|]*\|[^|]*\|[^|]*\| ([0-9.]+) \|", out).group(1)
    assert ratio > 1 and abs(float(bound) - 2.5 / ratio) < 0.02, (ratio, bound)


def test_speculative_floors_bound_the_speedup(monkeypatch, capsys, results_dir):
    """--floors counts, on an abstract model, the verify step's bytes in decode steps' for blocks of 2 .. k + 1
    tokens: at B = 1 more tokens route to more experts (the ratio grows, and the bound is tokens / ratio); at a
    batch whose tokens already touch every expert the ratio stays near 1. Nothing is recorded."""
    from benchmarks import speculative

    argv = ["speculative", "--preset", "tiny", "--batches", "1", "64", "--context", "40", "--num-draft", "3",
            "--floors"]  # fmt: skip
    monkeypatch.setattr("sys.argv", argv)
    speculative.main()
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (\d+) \| 40 \| (\d) \| [\d,]+ \| ([0-9.]+) \| ([0-9.]+) \|$", out, re.M)
    assert [(b, t) for b, t, _, _ in rows] == [(b, t) for b in ("1", "64") for t in "234"], out
    ratios = {(int(b), int(t)): float(r) for b, t, r, _ in rows}
    assert 1 < ratios[1, 2] < ratios[1, 3] < ratios[1, 4] < 4, ratios
    assert all(1 <= ratios[64, t] < 1.05 for t in (2, 3, 4)), ratios  # every expert read already
    assert all(abs(float(bound) - int(t) / float(r)) < 0.02 for _, t, r, bound in rows), rows
    assert not list(results_dir.glob("*.jsonl"))


@pytest.mark.slow
def test_speculative_own_replay_reaches_a_self_replaying_output():
    """In bf16 the replay of plain greedy parts from the speculative run; the fixed point replays the run's own
    output: every draft accepted (k + 1 tokens a verify step but the last), the output what it replays."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from benchmarks import speculative
    from benchmarks.gpu_parity import cut_config
    from hybrid_jax import PRESETS, HybridLM, generate
    from hybrid_jax.speculative import replay_drafter

    cfg = cut_config(PRESETS["tiny"](), 2, 4)
    model = HybridLM(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(3))
    ids = speculative.repetitive_prompt(2, 24, cfg.vocab_size)
    new, k = 13, 3
    plain = generate(model, ids, max_new_tokens=new)
    # this toy's bf16 blocks happen to agree with its decode steps: start from a continuation wrong everywhere
    # (runs that part at once), so the fixed point needs runs beyond the first
    wrong = (plain.tokens + 1) % cfg.vocab_size
    reference = jnp.concatenate([ids, wrong], axis=1)
    ms, out, runs, fixed = speculative.own_replay(model, ids, reference, new, k, None, 32, 1)
    assert fixed and ms > 0 and runs >= 2
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))
    again = generate(model, ids, max_new_tokens=new, draft=replay_drafter(jnp.concatenate([ids, out.tokens], 1)),
                     num_draft=k)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(out.tokens))
    # 12 tokens after the first, 4 a step: 3 steps, every draft accepted
    np.testing.assert_array_equal(np.asarray(out.drafted), [9, 9])
    np.testing.assert_array_equal(np.asarray(out.accepted), [9, 9])
    # every 2nd draft wrong: still a fixed point, and the wrong drafts are rejected
    _, out2, _, fixed2 = speculative.own_replay(model, ids, reference, new, k, 2, 32, 1)
    assert fixed2 and int(np.asarray(out2.accepted).sum()) < int(np.asarray(out2.drafted).sum())
    # out of runs: not a fixed point, and the output is that of the drafts last run (and timed): the wrong ones
    _, out3, runs3, fixed3 = speculative.own_replay(model, ids, reference, new, k, None, 1, 1)
    assert runs3 == 1 and not fixed3
    np.testing.assert_array_equal(np.asarray(out3.accepted), [0, 0])


@pytest.mark.slow
def test_prefix_cache_benchmark_runs_on_cpu(monkeypatch, capsys):
    """The prefix-cache benchmark at toy size: every case, the warm call hitting the whole stored prompt (its
    4 full blocks of 8; the 5th, partial, holds the last prompt token) and the bytes per cached token."""
    from benchmarks import prefix_cache

    argv = ["prefix_cache", "--preset", "tiny", "--layers", "2", "--experts", "4", "--prefix", "28", "--new", "5",
            "--block-sizes", "8",
            "--reps", "1", "--no-record"]  # fmt: skip
    monkeypatch.setattr("sys.argv", argv)
    prefix_cache.main()
    out = capsys.readouterr().out
    cases = ("| no cache, one shot |", "| no cache |", "| no cache, block chunks | 8 |", "| cold cache (storing) | 8 |",
             "| cold cache (storing), one call | 8 |", "| 32 tokens in one call + 1 in tail calls |",
             "| prefix in one prefill call | 8 |", "| prefix in one prefill call, snapshots every 8 | 8 |")  # fmt: skip
    for case in cases:
        assert case in out, out[-2000:]
    assert "x the call without snapshots |" in out
    assert "| warm cache | 8 |" in out and "| 32 of 33 hit; " in out, out[-2000:]
    assert "KiB/token (" in out


def test_mla_decode_benchmark_runs_on_cpu(fast_ceilings, monkeypatch, capsys):
    """The dense MLA decode benchmark at toy size in interpret mode: the default kernel, one variant, the bf16
    XLA baseline and the reference on a cache spanning more than the context, then the FP8 pool's rows."""
    from benchmarks import mla_decode

    monkeypatch.setattr(mla_decode, "ceilings", benchmarks.common.ceilings)
    argv = ["mla_decode", "--cases", "1:200", "--span", "320", "--fp8", "--variants", "32:64:4:2:3", "--calls", "1",
            "--no-record"]  # fmt: skip
    monkeypatch.setattr("sys.argv", argv)
    mla_decode.main()
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith("| dense MLA decode | B=1, S=200 in a 320 span")]
    assert len(rows) == 7, out[-3000:]  # BF16: 2 kernels, XLA, reference; FP8: 2 kernels, reference
    assert sum("rel err" in ln for ln in rows) == 5 and sum("FP8 latent" in ln for ln in rows) == 3
    for ln in rows:  # every kernel and baseline row agrees with the float32 reference
        if "rel err" in ln:
            assert float(ln.split("rel err ")[1].split()[0]) < 2e-2, ln


def test_profile_stage_topk_runs_each_selection_and_refuses_others(tmp_path, monkeypatch, capsys):
    """`profile_stage --stage topk`: the Top-K alone with each named selection, built by `sparse_attention.
    _selection` (recorded here and run as `lax.top_k`: the kernels in interpret mode take minutes; the CPU has
    no device kernels, so the tables are empty); a selection it does not know is a one-line CLI error."""
    import jax

    from benchmarks import profile_stage, sparse_attention

    asked = []

    def selection(select, best_first, s, topk, **knobs):
        asked.append((select, best_first, s, topk, knobs))
        return jax.jit(lambda x: jax.lax.top_k(x, topk))

    monkeypatch.setattr(sparse_attention, "_selection", selection)
    selects = ["split", "split_ranked", "kernel", "top_k", "split:pass_chunk=2048,num_warps=8"]
    argv = ["profile_stage", "--stage", "topk", "--batch", "2", "--context", "512", "--topk", "32", "--calls", "1",
            "--out", str(tmp_path), "--selects", *selects]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    profile_stage.main()
    out = capsys.readouterr().out
    assert asked == [
        ("split", False, 512, 32, {}), ("split", True, 512, 32, {}), ("kernel", False, 512, 32, {}),
        ("split", False, 512, 32, {"pass_chunk": 2048, "num_warps": 8}),
    ]  # fmt: skip
    for n, select in enumerate(selects):
        assert f"Top-32 of [2, 512] float32 normal scores, {select}:" in out
        assert (tmp_path / f"trace_topk_{n}_{select.partition(':')[0]}_r2").is_dir()
    for bad, err in (
        ("sort", "--selects sort: the topk stage takes split, split_ranked, kernel, top_k"),
        ("split:chunk=2", "--selects split:chunk=2: knobs are split's seg, num_warps"),
        ("kernel:num_warps=8", "--selects kernel:num_warps=8: knobs are split's"),
    ):  # fmt: skip
        monkeypatch.setattr(sys, "argv", [*argv[: -len(selects)], bad])
        with pytest.raises(SystemExit):
            profile_stage.main()
        assert err in capsys.readouterr().err


def test_profile_stage_kda_prefill_packs_the_benchmark_batch(tmp_path, monkeypatch, capsys):
    """`profile_stage --stage kda_prefill --varlen-seqs 3`: the tokens packed as `linear_attention`'s varlen
    batch of that many sequences (its lengths in the title; the CPU runs the jnp form, no device kernels)."""
    import pallas_kernels.linear_attention as la
    from benchmarks import profile_stage
    from benchmarks.linear_attention import varlen_offsets

    seen, kda = [], la.kda

    def spy(*a, cu_seqlens=None, **kw):
        seen.append(None if cu_seqlens is None else np.asarray(cu_seqlens).tolist())
        return kda(*a, cu_seqlens=cu_seqlens, **kw)

    monkeypatch.setattr(la, "kda", spy)
    argv = ["profile_stage", "--stage", "kda_prefill", "--tokens", "256", "--varlen-seqs", "3", "--calls", "1",
            "--out", str(tmp_path)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    profile_stage.main()
    cu = varlen_offsets(256, 3).tolist()
    assert len(cu) == 4 and cu[0] == 0 and cu[-1] == 256 and seen and all(x == cu for x in seen)
    assert f"3 packed sequences (lengths {np.diff(cu).tolist()})" in capsys.readouterr().out
    for bad in ("-1", "257"):
        monkeypatch.setattr(sys, "argv", [*argv[:5], f"--varlen-seqs={bad}", *argv[7:]])
        with pytest.raises(SystemExit):
            profile_stage.main()
        assert f"--varlen-seqs {bad}: must be in [0, 256] (the tokens)" in capsys.readouterr().err


@pytest.mark.slow
def test_kda_varlen_rows_time_both_state_passes(monkeypatch):
    """The varlen batch's rows: the reference, the chunk-aligned packing with the Triton state pass and with
    `mosaic` with the Mosaic GPU one (one program per sequence each), each checked against the reference
    (interpret mode, 3 sequences of 256 tokens in all, one head)."""
    from benchmarks import linear_attention
    from pallas_kernels.linear_attention import api

    monkeypatch.setattr(linear_attention, "median_ms", lambda fn, *a, **k: (jax.block_until_ready(fn()), 1.0)[1])
    ran = []  # which state pass each traced call took, and whether it wrote o in the sequences' rows
    real = api.kda_chunked_pallas

    def spy(*a, **k):
        ran.append((k["state_impl"], k.get("o_rows") is not None))
        return real(*a, **k)

    monkeypatch.setattr(api, "kda_chunked_pallas", spy)
    rows = linear_attention.varlen_rows(1e12, 1e14, None, 256, seqs=3, n=1, mosaic=True)
    runs = [name for i, name in enumerate(ran) if i == 0 or ran[i - 1] != name]  # a call may trace twice
    assert runs == [("triton", True), ("mosaic", True)], ran
    impls = [r["impl"] for r in rows]
    assert impls == ["jnp reference (XLA, chunked)", "pallas chunked, packed chunk-aligned (defaults)",
                     "Mosaic GPU state pass (Triton phase 1), one program per sequence"], impls  # fmt: skip
    for r in rows[1:]:
        assert float(r["check vs reference"].split("rel err ")[1]) < 2e-2, r


@pytest.mark.slow
def test_kda_prefill_benchmark_runs_on_cpu(fast_ceilings, monkeypatch, capsys):
    """`benchmarks.linear_attention --only prefill --phases --mosaic --a-blocks split --gate-scale 2` at a toy
    length: the jnp reference, one Pallas variant and the two Mosaic rows (kda's defaults; the binary split
    alone) checked against it, and phase 1 with each of its parts left out (interpret mode); the stronger gates
    are named in the shape; a bad --a-blocks or --gate-scale is one line."""
    from benchmarks import linear_attention

    monkeypatch.setattr(linear_attention, "ceilings", benchmarks.common.ceilings)
    # one timed call a row: the interpreters make each call seconds long, and the rows' values are not checked
    monkeypatch.setattr(linear_attention, "median_ms", lambda fn, *a, **k: (jax.block_until_ready(fn()), 1.0)[1])
    argv = ["linear_attention", "--only", "prefill", "--prefill-lens", "128", "--heads", "1", "--variants",
            "32x4:bf16", "--phases", "--varlen-total", "0", "--no-record", "--mosaic", "--a-blocks",
            "split", "--gate-scale", "2"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    linear_attention.main()
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| prefill")]
    labels = [ln.split(" | ")[2] for ln in rows]
    mosaic = "Mosaic GPU state pass (Triton phase 1), bf16 products"
    assert labels[:4] == ["jnp reference (XLA, chunked)", "pallas chunked, block_v=32, warps=4, bf16 products",
                          mosaic, f"{mosaic}, binary split"], labels  # fmt: skip
    assert labels[4:] == [label for _, label in linear_attention.PHASE_PARTS], labels
    for r in rows[1:4]:
        assert float(r.split("rel err ")[1].split()[0]) < 2e-2, r
    assert all(ln.split(" | ")[1] == "B=1 T=128 N=1 K=128 V=128 gates x2" for ln in rows), rows
    for bad in ("-1", "inf"):
        monkeypatch.setattr(sys, "argv", ["linear_attention", "--gate-scale", bad])
        with pytest.raises(SystemExit):
            linear_attention.main()
        assert f"--gate-scale={float(bad)} must be finite and > 0" in capsys.readouterr().err
    for bad in ("32,x", "16,64", ""):
        monkeypatch.setattr(sys, "argv", ["linear_attention", "--mosaic", "--a-blocks", bad])
        with pytest.raises(SystemExit):
            linear_attention.main()
        assert f"--a-blocks={bad!r} must be sizes from (64, 32, 16)" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["linear_attention", "--a-blocks", "64,16"])
    with pytest.raises(SystemExit):
        linear_attention.main()
    assert "--a-blocks='64,16' adds a Mosaic GPU row: it needs --mosaic" in capsys.readouterr().err


@pytest.mark.slow
def test_moe_benchmark_runs_on_cpu(fast_ceilings, monkeypatch, capsys):
    """The MoE benchmark at toy size in interpret mode: at one token every decode form (the gathered-weights
    XLA form, the per-pair GEMV kernels, the grouped matmuls) and at 512 tokens (a prefill-sized call) the
    grouped matmuls alone, each row checked against the first (`lax.ragged_dot`)."""
    from benchmarks import moe

    few_timings(monkeypatch, moe)
    monkeypatch.setattr(moe, "ceilings", benchmarks.common.ceilings)  # imported by name: the fixture's fake
    monkeypatch.setattr(moe, "chained_ms", lambda fn, *args: benchmarks.common.median_ms(lambda: fn(*args)))
    monkeypatch.setattr(moe, "SHAPES", {**moe.SHAPES, "tiny": (256, 128, 8, 2)})  # D divides every GEMV block_k
    monkeypatch.setattr("sys.argv", ["moe", "--shape", "tiny", "--tokens", "1", "512", "--no-record"])
    moe.main()
    out = capsys.readouterr().out
    rows = {t: [ln for ln in out.splitlines() if ln.startswith(f"| moe experts | tiny: {t} tokens")] for t in (1, 512)}
    n_grouped = len(moe.VARIANTS)
    assert len(rows[1]) == 2 + 1 + len(moe.GEMV_BLOCKS) + n_grouped + 1, out[-3000:]
    assert len(rows[512]) == 1 + n_grouped, out[-3000:]
    for ln in rows[1][1:] + rows[512][1:]:  # every kernel row agrees with lax.ragged_dot
        assert float(ln.split("rel err ")[1].split()[0]) < 2e-2, ln


def test_long_context_random_fill_is_blockwise_and_covers_every_row():
    """The random cache fill draws a block of the leading axis at a time (the full model's memory leaves no
    room for a float32 draw of a whole B=64 x 32K pool): every element of every row gets a value (no zero
    left, the overlapping last block included), in the array's dtype and shape, spread as 0.1 x normal; the
    compiled fill's temporaries scale with the block (on the CPU ~6x its float32 bytes: the bits and unfused
    intermediates; a whole-array draw of the shape below takes 64 MiB)."""
    from benchmarks.long_context import _fill

    x = jnp.zeros((37, 5, 24), jnp.bfloat16)  # 37 rows, blocks of 3 rows (1,440 bytes of float32 each)
    y = jax.jit(lambda x: _fill(x, jax.random.key(0), block_bytes=1440))(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    v = np.asarray(y, np.float32)
    assert (v != 0).all() and 0.08 < v.std() < 0.12 and abs(v.mean()) < 0.01
    assert len({tuple(r.ravel()[:4]) for r in v}) == 37  # each block its own draw
    big = jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16)  # 8 MiB bf16, a 16 MiB float32 draw if taken whole
    mem = jax.jit(lambda x: _fill(x, jax.random.key(0), block_bytes=1 << 20), donate_argnums=0).lower(big).compile()
    assert mem.memory_analysis().temp_size_in_bytes <= 8 << 20
    assert _fill(jnp.zeros((0, 3), jnp.bfloat16), jax.random.key(0)).shape == (0, 3)


def test_long_context_asks_for_gpu_memory_unless_the_caller_did():
    """95% of the GPU under jax's current name; a setting under either name (the deprecated one included:
    jax refuses both together) is left as it is."""
    from benchmarks.long_context import _claim_gpu_memory

    env = {}
    _claim_gpu_memory(env)
    assert env == {"XLA_CLIENT_MEM_FRACTION": "0.95"}
    for name in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        env = {name: "0.5"}
        _claim_gpu_memory(env)
        assert env == {name: "0.5"}


def test_sparse_mla_row_that_fails_to_run_is_recorded(capsys):
    """A kernel variant that does not run (a tile past the shared memory) leaves a "did not run" row and its
    reason in the log, so a sweep never drops it silently; one that runs gets its time and error."""
    import jax
    import jax.numpy as jnp

    from benchmarks.sparse_attention import _measured_row, row

    ref = jnp.arange(6.0).reshape(2, 3)
    ctx = ("sparse MLA decode", "B=2", 1e6, 1e12, 1e15, ref, lambda fn, *a: 0.25, lambda fn, *a: "; kernels 0.2 ms")

    def fails(x):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: shared memory 300000 > 232448")

    bad = _measured_row(ctx, "pallas, block_h=64", fails, (ref,), 1000)
    nan = float("nan")
    assert bad == row(
        "sparse MLA decode", "B=2", "pallas, block_h=64", nan, 1e6, 1000, 1e12, 1e15, "did not run (see log)"
    )
    assert "pallas, block_h=64: did not run: RESOURCE_EXHAUSTED: shared memory 300000" in capsys.readouterr().out
    good = _measured_row(ctx, "mosaic", lambda x: (x * 1.001,), (ref,), 1000, " (FP8 rounding)")
    check = good["check vs reference"]
    assert check.startswith("rel err 1.0e-03") and check.endswith(" (FP8 rounding); kernels 0.2 ms"), good
    assert good == row("sparse MLA decode", "B=2", "mosaic", 0.25, 1e6, 1000, 1e12, 1e15, check)
