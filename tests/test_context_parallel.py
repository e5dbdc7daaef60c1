"""Context parallelism on 8 fake CPU devices (run in a subprocess: JAX is already started here)."""

import contextlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from sharding.zigzag import causal_work, from_zigzag, layout_order, to_zigzag
from tests.conftest import xla_flags

ROOT = Path(__file__).resolve().parent.parent


def run_on_fake_devices(script: str, n: int = 8, timeout: int = 900, optimize: bool = False) -> str:
    """Run `script` in a subprocess on n fake CPU devices; its stdout. optimize: XLA's default optimisation level
    instead of the tests' level 0 (at level 0 XLA's CPU code for some float32 ops is less accurate, and a few
    comparisons of differently compiled programs see it)."""
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}" if optimize else xla_flags(n),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(ROOT),
    }
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


_CP_TP_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
jax.config.update("jax_default_matmul_precision", "highest")
from hybrid_jax import HybridLM
from sharding import make_mesh, shard_params
from sharding.context_parallel import prefill_context_parallel
{setup}
model = HybridLM(cfg, rngs=nnx.Rngs(0))
vocab = cfg.vocab_size
head = jax.random.randint(jax.random.key(1), (2, 5), 0, vocab)
ids = jax.random.randint(jax.random.key(2), (2, 45), 0, vocab)
nxt = jax.random.randint(jax.random.key(3), (2,), 0, vocab)
prefill = jax.jit(lambda m, i, c, n: m.prefill(i, c, n))
decode = jax.jit(lambda m, i, c: m.decode_step(i, c))
rel = lambda a, b: float(np.linalg.norm(np.asarray(a, np.float32) - np.asarray(b, np.float32))
                         / max(np.linalg.norm(np.asarray(b, np.float32)), 1e-30))
# the head right-padded to the prompt's shape: one prefill compile for the head and the references
padded_head = jnp.zeros_like(ids).at[:, :5].set(head)
start = prefill(model, padded_head, model.init_cache(2, 64), jnp.full((2,), 5))[1]
n = jnp.full((2,), ids.shape[1])
refs = {{c: prefill(model, ids, start if c else model.init_cache(2, 64), n) for c in (False, True)}}
ref_next = decode(model, nxt, refs[True][1])[0]
for cached, cp, tp, layout in ((False, 2, 4, "sequential"), (True, 4, 2, "zigzag")):
    ref_logits, ref_cache = refs[cached]
    mesh = make_mesh(cp=cp, tp=tp)
    m = shard_params(HybridLM(cfg, rngs=nnx.Rngs(0)), mesh)
    c = start if cached else m.init_cache(2, 64)
    logits, cache = prefill_context_parallel(m, ids, c, mesh=mesh, layout=layout)
    errs = [rel(logits, ref_logits)]
    errs += [rel(a, b) for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(ref_cache), strict=True)]
    if cached:  # the next decode step on the tp-sharded model (CI time: a compile per mesh), once
        errs.append(rel(decode(m, nxt, cache)[0], ref_next))
    assert max(errs) < 1e-5, (cached, cp, tp, layout, errs)
if {dp_tp}:  # the forward on a dp x tp mesh: an empty cache's prefill gave the forward's logits
    with jax.set_mesh(make_mesh(dp=2, tp=4)):
        m = shard_params(HybridLM(cfg, rngs=nnx.Rngs(0)), make_mesh(dp=2, tp=4))
        got = np.asarray(jax.jit(lambda m, i: m(i))(m, ids))
    assert rel(got, refs[False][0]) < 1e-5, rel(got, refs[False][0])
print("OK")
"""


def assert_cp_tp_equal_one_device(setup: str, dp_tp: bool = False) -> None:
    """On 8 fake devices (XLA's default optimisation level), the model `setup` builds (Python lines defining
    `cfg`) prefills context-parallel with parameters sharded over tp — cp 2 x tp 4 sequential from an empty
    cache, cp 4 x tp 2 zigzag after a 5-token cached head — and gives the single-device logits, every cache
    leaf and the next decode step (1e-5); dp_tp: also the forward on a dp 2 x tp 4 mesh."""
    out = run_on_fake_devices(_CP_TP_SCRIPT.format(setup=textwrap.dedent(setup), dp_tp=dp_tp), optimize=True)
    assert "OK" in out


def four_layer_tiny():
    """The tiny model cut to its first four layers (CI time: the subprocess tests compile the whole model once
    per mesh): still one layer of every kind (KDA, sparse MLA with its indexer, full MLA; the dense MLP and MoE)
    and two Block AttnRes blocks."""
    from hybrid_jax import HybridConfig

    cfg = HybridConfig.tiny()
    return cfg.replace(num_layers=4, layer_types=cfg.layer_types[:4], mlp_types=cfg.mlp_types[:4])


def test_zigzag_round_trips_and_pairs_head_with_tail():
    x = np.arange(2 * 32).reshape(2, 32)
    z = to_zigzag(x, 4)
    np.testing.assert_array_equal(from_zigzag(z, 4), x)
    np.testing.assert_array_equal(layout_order(16, 4).reshape(4, 4)[0], [0, 1, 14, 15])
    with pytest.raises(ValueError, match="not a multiple of 8"):
        layout_order(20, 4)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_zigzag_balances_causal_work(cp):
    zig = causal_work(4096, cp, "zigzag")
    seq = causal_work(4096, cp, "sequential")
    assert zig.max() / zig.min() <= 1.01
    assert seq.max() / seq.min() > 2  # the sequential split's last device does far more
    assert zig.sum() == seq.sum() == 4096 * 4097 // 2


@pytest.mark.slow
def test_state_parallel_kda_equals_single_device():
    out = run_on_fake_devices("""
        import jax, jax.numpy as jnp, numpy as np
        jax.config.update("jax_default_matmul_precision", "highest")
        from pallas_kernels.linear_attention import kda
        from sharding.mesh import make_mesh
        from sharding.state_parallel import kda_context_parallel
        from sharding.zigzag import layout_order
        ks = jax.random.split(jax.random.key(0), 6)
        b, t, n, d = 2, 96, 2, 8
        q, k, v = (jax.random.normal(kk, (b, t, n, d)) for kk in ks[:3])
        g = -jax.nn.softplus(jax.random.normal(ks[3], (b, t, n, d)))
        beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, n)))
        s0 = jax.random.normal(ks[5], (b, n, d, d))
        ref_o, ref_s = kda(q, k, v, g, beta, initial_state=s0, impl="reference", form="chunked", chunk_size=8)
        rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
        for cp in (2, 4, 8):
            for layout in ("sequential", "zigzag"):
                mesh = make_mesh(cp=cp, dp=8 // cp)
                order = layout_order(t, cp, layout)
                o, s = kda_context_parallel(q[:, order], k[:, order], v[:, order], g[:, order], beta[:, order],
                                            mesh=mesh, layout=layout, initial_state=s0, chunk_size=8)
                assert tuple(o.sharding.spec)[:2] == (None, "cp"), o.sharding  # the output stays split over cp
                o = o[:, np.argsort(order)]
                assert rel(o, ref_o) < 1e-5 and rel(s, ref_s) < 1e-5, (cp, layout, rel(o, ref_o), rel(s, ref_s))
        print("OK")
    """)
    assert "OK" in out


@pytest.mark.slow
def test_tensor_parallel_forward_and_generate_equal_single_device():
    out = run_on_fake_devices("""
        import jax, jax.numpy as jnp, numpy as np
        from flax import nnx
        jax.config.update("jax_default_matmul_precision", "highest")
        from hybrid_jax import HybridConfig, HybridLM, generate
        from sharding import make_mesh, shard_params
        from tests.test_context_parallel import four_layer_tiny
        cfg = four_layer_tiny()
        ids = jax.random.randint(jax.random.key(0), (2, 11), 0, 256)
        fwd = jax.jit(lambda m, i: m(i))
        gen = jax.jit(generate, static_argnames=("max_new_tokens",))
        ref_model = HybridLM(cfg, rngs=nnx.Rngs(0))
        ref_logits = np.asarray(fwd(ref_model, ids))
        ref_tokens = np.asarray(gen(ref_model, ids, max_new_tokens=6).tokens)
        for dp, tp in ((1, 8), (2, 4)):
            mesh = make_mesh(dp=dp, tp=tp)
            model = shard_params(HybridLM(cfg, rngs=nnx.Rngs(0)), mesh)
            kernel = model.layers[2].self_attn.kv_b_proj.kernel[...]
            assert kernel.sharding.spec[1] == "tp" and len(kernel.addressable_shards) == 8
            with jax.set_mesh(mesh):  # the residual stream becomes sequence-parallel over tp
                lowered = fwd.lower(model, jnp.zeros((4, 16), jnp.int32)).as_text()
                logits = np.asarray(fwd(model, ids))
                # generate once, on the mesh with dp and tp (CI time: two compiles per mesh); tp = 8, more
                # devices than heads, by the forward. Speculative decoding: the verify step's snapshots placed
                # like the states
                if (dp, tp) == (2, 4):
                    tokens = np.asarray(gen(model, ids, max_new_tokens=6).tokens)
                    np.testing.assert_array_equal(tokens, ref_tokens)
                    spec = jax.jit(generate, static_argnames=("max_new_tokens", "draft", "num_draft"))
                    out = spec(model, ids, max_new_tokens=6, draft="ngram", num_draft=2)
                    np.testing.assert_array_equal(np.asarray(out.tokens), ref_tokens)
            # a constraint at every layer boundary (and after the embedding)
            assert lowered.count('[{"dp"}, {"cp", "tp"}, {}]> : tensor<4x16x') >= cfg.num_layers + 1, (dp, tp)
            rel = np.linalg.norm(logits - ref_logits) / np.linalg.norm(ref_logits)
            assert rel < 1e-5, (dp, tp, rel)
        # sequence-parallel residual: split over dp (batch) and tp (time) when the sizes divide
        from sharding import constrain
        with jax.set_mesh(make_mesh(dp=2, tp=4)):
            x = jax.jit(lambda x: constrain(x, ("batch", "act_seq", "embed")))(jnp.ones((2, 16, 8)))
            one = jax.jit(lambda x: constrain(x, ("batch", "act_seq", "embed")))(jnp.ones((2, 1, 8)))
        assert x.addressable_shards[0].data.shape == (1, 4, 8), x.sharding
        assert one.addressable_shards[0].data.shape == (1, 1, 8), one.sharding  # a decode step stays whole in time
        print("OK")
    """)
    assert "OK" in out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _two_processes(argv_and_env):
    """Start process 0 and 1 of a 2-process job on localhost (2 fake CPU devices each); yields the processes
    and kills any still running on the way out (a failed test leaves none waiting at a barrier)."""
    coordinator = f"127.0.0.1:{_free_port()}"
    base = {
        **os.environ,
        "XLA_FLAGS": xla_flags(2),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(ROOT),
    }
    procs = []
    try:
        for i in range(2):
            argv, env = argv_and_env(i, coordinator)
            procs.append(
                subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**base, **env})
            )
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def _finish(procs, timeout=600) -> list[str]:
    """Wait for a job's processes; their stdout (each must exit 0)."""
    outs = [p.communicate(timeout=timeout) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-4000:]
    return [o for o, _ in outs]


@pytest.mark.slow
def test_two_process_jobs_build_one_mesh_and_match_one_process(tmp_path, capsys):
    """Two 2-process jobs on localhost, run together (the first one's process 1 sleeps 35 s; the second runs
    meanwhile): a dp 2 x tp 2 forward whose logits equal the single-process ones, with a host that compiles 35 s
    slower than the other (past gloo's fixed 30 s set-up deadline, which `barrier` absorbs); and the CLI's
    `generate --tp 4` over both processes, whose tokens equal a single-process run's, reported once."""
    import jax
    from flax import nnx

    from hybrid_jax import HybridLM
    from hybrid_jax.cli import main

    ids = jax.random.randint(jax.random.key(5), (2, 9), 0, 256)
    np.save(tmp_path / "ids.npy", np.asarray(ids))
    script = textwrap.dedent(f"""
        import jax, numpy as np
        from flax import nnx
        from jax.experimental import multihost_utils
        from sharding.launch import barrier, initialize, spec_from
        initialize(spec_from())  # from the HYBRID_JAX_* environment variables
        jax.config.update("jax_default_matmul_precision", "highest")
        from hybrid_jax import HybridLM
        from sharding import make_mesh, shard_params
        assert jax.process_count() == 2 and jax.device_count() == 4 and jax.local_device_count() == 2
        from tests.test_context_parallel import four_layer_tiny
        model = shard_params(HybridLM(four_layer_tiny(), rngs=nnx.Rngs(0)), make_mesh(dp=2, tp=2))
        ids = np.load({str(tmp_path / "ids.npy")!r})
        forward = jax.jit(lambda m, i: m(i)).lower(model, ids).compile()
        if jax.process_index() == 1:  # a host that compiles 35 s slower: past gloo's fixed 30 s set-up deadline
            import time; time.sleep(35)
        barrier("compiled")  # without it, process 0's first collective gives up waiting for process 1
        logits = multihost_utils.process_allgather(forward(model, ids), tiled=True)
        np.save({str(tmp_path)!r} + f"/logits{{jax.process_index()}}.npy", np.asarray(logits))
        print("OK", jax.process_index())
    """)

    def mesh_job(i, coordinator):
        env = {"HYBRID_JAX_COORDINATOR": coordinator, "HYBRID_JAX_NUM_PROCESSES": "2", "HYBRID_JAX_PROCESS_ID": str(i)}
        return [sys.executable, "-c", script], env

    def cli_job(i, coordinator):
        argv = [sys.executable, "-m", "hybrid_jax", "generate", "--max-new-tokens", "5", "--compile-cache", "",
                "--tp", "4", "--coordinator", coordinator, "--num-processes", "2", "--process-id", str(i)]  # fmt: skip
        return argv, {}

    with _two_processes(mesh_job) as mesh:
        ref = np.asarray(jax.jit(lambda m, i: m(i))(HybridLM(four_layer_tiny(), rngs=nnx.Rngs(0)), ids))
        assert main(["generate", "--max-new-tokens", "5", "--compile-cache", ""]) == 0
        single = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("tokens:"))
        with _two_processes(cli_job) as procs:
            cli = _finish(procs)
        assert single in cli[0].splitlines() and "mesh: dp=1 tp=4 over 4 devices in 2 process(es)" in cli[0]
        assert "tokens:" not in cli[1]  # one report per job
        assert all("OK" in o for o in _finish(mesh))
    for i in range(2):
        got = np.load(tmp_path / f"logits{i}.npy")
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-5


def test_distributed_spec_errors_name_the_value():
    from sharding.launch import DistributedSpec, spec_from

    assert spec_from(None, environ={}) is None
    with pytest.raises(ValueError, match=r"\['process_id'\] missing"):
        spec_from(None, environ={"HYBRID_JAX_COORDINATOR": "h:1", "HYBRID_JAX_NUM_PROCESSES": "2"})
    with pytest.raises(ValueError, match="process_id=2"):
        DistributedSpec("h:1", 2, 2)
    with pytest.raises(ValueError, match="coordinator='host'"):
        DistributedSpec("host", 2, 0)


@pytest.mark.slow
def test_whole_model_context_parallel_prefill_equals_single_device():
    out = run_on_fake_devices("""
        import jax, jax.numpy as jnp, numpy as np
        from flax import nnx
        jax.config.update("jax_default_matmul_precision", "highest")
        from hybrid_jax import HybridLM
        from sharding import make_mesh, shard_params
        from sharding.context_parallel import forward_context_parallel
        from tests.test_context_parallel import four_layer_tiny
        cfg = four_layer_tiny()
        model = HybridLM(cfg, rngs=nnx.Rngs(0))
        # 137 tokens: a multiple of no layout's piece count, so every case pads internally
        ids = jax.random.randint(jax.random.key(1), (2, 137), 0, 256)
        ref = np.asarray(jax.jit(lambda m, i: m(i))(model, ids))
        # CI time: one whole-model compile per case. Without a cache: each layout once (zigzag at cp = 8: the
        # smallest pieces, 16 of 9 tokens); with one: cp 2 / 4 in the decode-cache test, 2 in the multigpu one
        got = np.asarray(forward_context_parallel(model, ids, mesh=make_mesh(cp=4, dp=2), layout="sequential"))
        rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert rel < 1e-5, rel
        # CP x TP: parameters sharded over tp by the rules, the sequence over cp.
        for cp, tp, layout in ((1, 8, "sequential"), (8, 1, "zigzag")):
            mesh = make_mesh(cp=cp, tp=tp)
            sharded = shard_params(HybridLM(cfg, rngs=nnx.Rngs(0)), mesh)
            got = np.asarray(forward_context_parallel(sharded, ids, mesh=mesh, layout=layout))
            rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
            assert rel < 1e-5, (cp, tp, rel)
        print("OK")
    """)
    assert "OK" in out


@pytest.mark.slow
def test_context_parallel_prefill_fills_the_decode_cache():
    out = run_on_fake_devices("""
        import jax, jax.numpy as jnp, numpy as np
        from flax import nnx
        jax.config.update("jax_default_matmul_precision", "highest")
        from hybrid_jax import HybridLM
        from sharding import make_mesh, shard_params
        from sharding.context_parallel import prefill_context_parallel
        from tests.test_context_parallel import four_layer_tiny
        cfg = four_layer_tiny()
        model = HybridLM(cfg, rngs=nnx.Rngs(0))
        head = jax.random.randint(jax.random.key(1), (2, 5), 0, 256)  # cached before the CP prefill
        ids = jax.random.randint(jax.random.key(2), (2, 137), 0, 256)  # padded inside for every layout
        nxt = jax.random.randint(jax.random.key(3), (2,), 0, 256)
        prefill = jax.jit(lambda m, i, c, n: m.prefill(i, c, n))
        decode = jax.jit(lambda m, i, c: m.decode_step(i, c))
        rel = lambda a, b: float(np.linalg.norm(np.asarray(a, np.float32) - np.asarray(b, np.float32))
                                 / max(np.linalg.norm(np.asarray(b, np.float32)), 1e-30))
        # the head right-padded to the prompt's shape: one prefill compile for the head and the references
        padded_head = jnp.zeros_like(ids).at[:, :5].set(head)
        start = prefill(model, padded_head, model.init_cache(2, 160), jnp.full((2,), 5))[1]
        n = jnp.full((2,), ids.shape[1])
        refs = {}
        for cached in (False, True):
            ref_logits, ref_cache = prefill(model, ids, start if cached else model.init_cache(2, 160), n)
            refs[cached] = ref_logits, ref_cache, decode(model, nxt, ref_cache)[0]
        # an empty and a non-empty cache, two meshes and both layouts (CI time: one whole-model compile per
        # prefill, so `last_only` once: the last row is device 0's second piece here; the sequential split's
        # last device is in the multigpu benchmark test; cp = 8 with the smallest pieces: the whole-model test)
        for cached, cp, tp, layout in ((False, 2, 4, "sequential"), (True, 4, 2, "zigzag")):
            ref_logits, ref_cache, ref_next = refs[cached]
            mesh = make_mesh(cp=cp, tp=tp)
            m = shard_params(HybridLM(cfg, rngs=nnx.Rngs(0)), mesh)
            c = start if cached else m.init_cache(2, 160)
            logits, cache = prefill_context_parallel(m, ids, c, mesh=mesh, layout=layout)
            assert int(cache.lengths[0]) == int(ref_cache.lengths[0])
            errs = [rel(logits, ref_logits)]
            if cached:
                last, _ = prefill_context_parallel(m, ids, c, mesh=mesh, layout=layout, last_only=True)
                errs.append(rel(last, ref_logits[:, -1]))
            errs += [rel(a, b) for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(ref_cache), strict=True)]
            errs.append(rel(decode(m, nxt, cache)[0], ref_next))  # decode continues from the CP-filled cache
            assert max(errs) < 1e-5, (cached, cp, tp, layout, errs)
        full = model.init_cache(2, 40)
        try:
            prefill_context_parallel(model, ids, full, mesh=make_mesh(cp=2, tp=4))
        except ValueError as e:
            assert "exceed the cache capacity max_len=40" in str(e), e
        else:
            raise AssertionError("no capacity error")
        print("OK")
    """)
    assert "OK" in out


@pytest.mark.slow
def test_multigpu_benchmark_runs_on_fake_devices():
    """The issue-9 benchmark script end to end at toy size (4 fake devices): CP and TP rows, outputs checked.
    `--layers 2` cuts tiny to four layers, one of every kind (CI time: each mesh compiles the whole model)."""
    env = {
        **os.environ,
        "XLA_FLAGS": xla_flags(4),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(ROOT),
    }
    argv = [sys.executable, "-m", "benchmarks.multigpu", "--config", "tiny", "--layers", "2", "--prompt-len", "64"]
    argv += ["--cps", "1", "2", "--cp-tp", "2x2", "4x2", "--tps", "1", "2", "--batch", "2", "--context", "16"]
    argv += ["--decode-steps", "3", "--dtype", "float32", "--iters", "1", "--no-record"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert "skipped (need more than 4 devices): prefill cp=4 tp=2" in out and "tiny cut to 4 layers" in out
    rows = [line for line in out.splitlines() if line.startswith("| prefill") or line.startswith("| decode")]
    assert len(rows) == 6, out  # cp=1, cp=2 zigzag + sequential, 2x2; decode tp=1, tp=2
    for line in rows[:4]:
        err = float(line.split("last logits rel err ")[1].split()[0])
        assert err < 1e-5, line
    assert all("same greedy tokens" in line for line in rows[4:]), out
