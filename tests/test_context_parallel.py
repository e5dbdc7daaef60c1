"""Context parallelism on 8 fake CPU devices (run in a subprocess: JAX is already started here)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from sharding.zigzag import causal_work, from_zigzag, layout_order, to_zigzag

ROOT = Path(__file__).resolve().parent.parent


def run_on_fake_devices(script: str, n: int = 8, timeout: int = 900) -> str:
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(ROOT),
    }
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


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
        ref_o, ref_s = kda(q, k, v, g, beta, initial_state=s0, impl="chunked", chunk_size=8)
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


def test_tensor_parallel_forward_and_generate_equal_single_device():
    out = run_on_fake_devices("""
        import jax, jax.numpy as jnp, numpy as np
        from flax import nnx
        jax.config.update("jax_default_matmul_precision", "highest")
        from hybrid_jax import HybridConfig, HybridLM, generate
        from sharding import make_mesh, shard_params
        cfg = HybridConfig.tiny()
        ids = jax.random.randint(jax.random.key(0), (2, 11), 0, 256)
        fwd = jax.jit(lambda m, i: m(i))
        gen = jax.jit(generate, static_argnames=("max_new_tokens",))
        ref_model = HybridLM(cfg, rngs=nnx.Rngs(0))
        ref_logits = np.asarray(fwd(ref_model, ids))
        ref_tokens = np.asarray(gen(ref_model, ids, max_new_tokens=6).tokens)
        for dp, tp in ((1, 8), (2, 4), (4, 2)):
            model = shard_params(HybridLM(cfg, rngs=nnx.Rngs(0)), make_mesh(dp=dp, tp=tp))
            kernel = model.layers[2].self_attn.kv_b_proj.kernel[...]
            assert kernel.sharding.spec[1] == "tp" and len(kernel.addressable_shards) == 8
            logits = np.asarray(fwd(model, ids))
            rel = np.linalg.norm(logits - ref_logits) / np.linalg.norm(ref_logits)
            assert rel < 1e-5, (dp, tp, rel)
            np.testing.assert_array_equal(np.asarray(gen(model, ids, max_new_tokens=6).tokens), ref_tokens)
        print("OK")
    """)
    assert "OK" in out
