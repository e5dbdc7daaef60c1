import gc
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import settings

from hybrid_jax import HybridConfig, HybridLM

# XLA's LLVM optimisation level 0 for the tests: the suite is dominated by compiling (thousands of small
# interpret-mode and whole-model programs), which level 0 makes about a third faster. The tests compare paths
# within one process, so the generated code's speed matters little (level 0 does not turn on fast math). Set
# before any backend starts; subprocesses take the same flags through `xla_flags(n)`. LLVM's expensive passes
# off as well made the whole suite no faster: the compile-bound tests gained what the interpret-mode kernel
# tests, whose running takes their time, lost (docs/performance.md, "Test suite time").
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = f"{TEST_XLA_FLAGS} {os.environ.get('XLA_FLAGS', '')}".strip()
# Many tests build the same programs (a tiny model's prefill, decode loop, ...): JAX's persistent compilation
# cache lets the second one load the first one's executable. One folder per checkout (a clean clone starts
# empty), shared by the xdist workers and, through the environment, by subprocesses. The cache is keyed by the
# program, its flags and the device, so a hit runs exactly what a compile would have built.
# HYBRID_JAX_TEST_COMPILE_CACHE=0 switches it off.
if os.environ.get("HYBRID_JAX_TEST_COMPILE_CACHE", "1") != "0":
    _cache = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache", "xla")
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _cache)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")


QUICK = False  # the quick tier (`-m "not slow"`): set by pytest_configure before the test modules are collected


def pytest_configure(config):
    global QUICK
    QUICK = "not slow" in (config.getoption("markexpr") or "")


def pytest_collection_modifyitems(config, items):
    """The slow tests first (a stable sort): with two workers, the long ones start early and the short ones fill
    the gaps at the end instead of one long test running alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def examples(n: int) -> int:
    """A hypothesis test's example count: n in the full suite, 2 in the quick tier (every kernel still runs,
    on fewer drawn shapes)."""
    return min(n, 2) if QUICK else n


def lower_for_sm90_in_subprocess(script: str) -> None:
    """Run `script` (it lowers Mosaic GPU kernels for sm_90 and prints "lowered") in a CPU-only subprocess with
    the CUDA plugin's Python files first on sys.path (argv[1]); skip where $HYBRID_JAX_CUDA_PLUGIN_DIR does not
    hold an unpacked jax-cuda13-plugin wheel (`pip download --no-deps jax-cuda13-plugin==<jax version>` and
    unzip: the README's test commands; CI sets it)."""
    import subprocess
    import sys

    where = os.environ.get("HYBRID_JAX_CUDA_PLUGIN_DIR")
    if not where or not os.path.isdir(os.path.join(where, "jax_cuda13_plugin")):
        pytest.skip("HYBRID_JAX_CUDA_PLUGIN_DIR does not hold an unpacked jax-cuda13-plugin wheel")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.getcwd())
    res = subprocess.run(
        [sys.executable, "-c", script, where], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert res.returncode == 0 and "lowered" in res.stdout, res.stderr[-3000:]


# XLA backend level 2 instead of the tests' level 0, for a program whose running, not its compile, takes a
# test's time (the recall model over 500 prompts runs about 3x faster at level 2 and compiles as fast).
OPTIMIZED = {"xla_backend_optimization_level": 2}


def compile_optimized(jitted, *args):
    """`jitted` (a `jax.jit` function) compiled for `args` at `OPTIMIZED`'s backend level instead of the tests'
    level 0; call the result with the same arguments."""
    return jitted.lower(*args).compile(OPTIMIZED)


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a test subprocess on `devices` fake CPU devices."""
    return f"{TEST_XLA_FLAGS} --xla_force_host_platform_device_count={devices}"


# Hypothesis draws the same examples on every run ("ci": derandomized, no deadline: interpret-mode kernels and
# first-call compiles take seconds). The tests' own @settings (max_examples) inherit this profile; set
# HYPOTHESIS_PROFILE=explore to draw fresh examples locally.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("explore", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The tests compare float32 paths against each other; on a GPU, XLA's default float32 matmul precision
# (TF32) would add ~1e-4 noise that differs between shapes. (A no-op on the CPU.)
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """Drop the compiled executables after each test module. Every XLA CPU executable holds its own memory
    mappings, and the suite compiles thousands (interpret-mode kernels over hypothesis-drawn shapes): one
    module alone leaves ~11K mappings, and the whole suite ran into the kernel's 65,530-mapping limit
    (vm.max_map_count) and died in XLA's compiler with SIGSEGV / SIGABRT."""
    yield
    jax.clear_caches()
    gc.collect()


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.isfinite(a).all() and np.isfinite(b).all(), "NaN/Inf in compared arrays"
    den = np.linalg.norm(b)
    # an all-zero reference (e.g. every query selected nothing): the absolute error, not 0 / 0
    return float(np.linalg.norm(a - b) / den) if den > 0 else float(np.linalg.norm(a))


def variant_config() -> HybridConfig:
    """The tiny model with the other side of every switch: no AttnRes, Gated DeltaNet scalar decay with a
    full-rank gate, full-rank output gate, NoPE MLA without q-LoRA, no indexer RoPE, softmax routing
    without groups, no shared expert, tied embeddings."""
    return HybridConfig.tiny().replace(
        layer_types=("sparse", "linear", "full", "linear", "sparse", "linear"),
        kda_scalar_decay=True,
        kda_decay_rank=None,
        kda_output_gate_rank=None,
        q_lora_rank=None,
        mla_use_rope=False,
        rope_scaling=None,
        mla_output_gate=False,
        index_rope_dim=0,
        scoring_func="softmax",
        n_group=1,
        topk_group=1,
        num_shared_experts=0,
        norm_topk_prob=False,
        attn_res_block_size=None,
        tie_word_embeddings=True,
    )


@pytest.fixture(scope="session")
def tiny_cfg() -> HybridConfig:
    return HybridConfig.tiny()


@pytest.fixture(scope="session")
def tiny_model(tiny_cfg) -> HybridLM:
    return HybridLM(tiny_cfg, rngs=nnx.Rngs(0))


@pytest.fixture(scope="session")
def jitted():
    """Jitted entry points shared by the tests (one compilation per shape)."""
    return {
        "forward": jax.jit(lambda m, ids: m(ids)),
        "prefill": jax.jit(lambda m, ids, c, n: m.prefill(ids, c, n)),
        "decode": jax.jit(lambda m, ids, c: m.decode_step(ids, c)),
    }


def random_ids(key: int, shape, vocab: int = 256) -> jnp.ndarray:
    return jax.random.randint(jax.random.key(key), shape, 0, vocab, dtype=jnp.int32)


def prefill_then_decode(model, ids, jitted, n_prefill: int, max_len: int):
    """Prefill the first n_prefill tokens, then decode the rest one at a time through the caches.
    Returns (logits [B, T, V] stitched from all calls, final cache)."""
    b, t = ids.shape
    cache = model.init_cache(b, max_len)
    logits, cache = jitted["prefill"](model, ids[:, :n_prefill], cache, jnp.full((b,), n_prefill))
    steps = [logits]
    for i in range(n_prefill, t):
        lg, cache = jitted["decode"](model, ids[:, i], cache)
        steps.append(lg[:, None])
    return jnp.concatenate(steps, axis=1), cache


def fresh_jits():
    """Jitted prefill / decode of fresh functions: `use_pallas()` is read at trace time, so each side of a
    comparison traces its own."""
    return {
        "prefill": jax.jit(lambda m, ids, c, n: m.prefill(ids, c, n)),
        "decode": jax.jit(lambda m, ids, c: m.decode_step(ids, c)),
    }


def decode_with_ops(model, ids, ops, n_prefill: int = 7, max_len: int = 16):
    """`prefill_then_decode` with the defaults and inside `use_pallas(ops=ops)`: (reference (logits, cache),
    switched (logits, cache), the decode step's jaxpr text under the switch)."""
    from pallas_kernels import use_pallas

    ref = prefill_then_decode(model, ids, fresh_jits(), n_prefill, max_len)
    with use_pallas(ops=ops):
        cache = model.init_cache(ids.shape[0], max_len)
        traced = str(jax.make_jaxpr(lambda m, i, c: m.decode_step(i, c))(model, ids[:, 0], cache))
        got = prefill_then_decode(model, ids, fresh_jits(), n_prefill, max_len)
    return ref, got, traced
