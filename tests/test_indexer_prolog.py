"""The indexer's fused decode prolog (`indexer_prolog`): the Pallas kernel (interpret mode) against the jnp
reference, the reference against the layer's step-by-step modules, the GPU rule and the errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_jax import HybridLM
from hybrid_jax.layers.rope import attention_factor, inv_frequencies, rope_tables
from pallas_kernels import use_pallas
from pallas_kernels.indexer import api, indexer_prolog
from tests.conftest import examples, rel_err


def _case(seed, m, d, q_in, n, h, r, dtype=jnp.bfloat16):
    ks = jax.random.split(jax.random.key(seed), 8)
    ang = jax.random.uniform(ks[7], (m, r // 2), maxval=6.0)
    return (
        jax.random.normal(ks[0], (m, d)).astype(dtype),
        jax.random.normal(ks[1], (m, q_in)).astype(dtype),
        (jax.random.normal(ks[2], (q_in, n * h)) * q_in**-0.5).astype(dtype),
        (jax.random.normal(ks[3], (d, h)) * d**-0.5).astype(dtype),
        1.0 + 0.2 * jax.random.normal(ks[4], (h,)),
        0.2 * jax.random.normal(ks[5], (h,)),
        jax.random.normal(ks[6], (d, n)) * d**-0.5,
        1.1 * jnp.cos(ang),  # an attention factor != 1 on the tables
        1.1 * jnp.sin(ang),
    )


@settings(max_examples=examples(4), deadline=None)
@given(
    seed=st.integers(0, 2**16),
    m=st.integers(1, 19),  # rows padded to a power of two >= 16 inside
    d=st.sampled_from([32, 48]),
    q_in=st.sampled_from([16, 80]),
    n=st.integers(1, 5),
    hr=st.sampled_from([(16, 0), (32, 8), (32, 32), (64, 16)]),  # no RoPE, partial, all channels rotary
    dtype=st.sampled_from([jnp.bfloat16, jnp.float32]),
)
def test_kernel_matches_reference(seed, m, d, q_in, n, hr, dtype):
    h, r = hr
    args = _case(seed, m, d, q_in, n, h, r, dtype)
    kw = dict(num_heads=n, rope_dim=r, eps=1e-6)
    ref = indexer_prolog(*args, impl="reference", **kw)
    got = indexer_prolog(*args, impl="pallas", interpret=True, **kw)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2  # bf16: a rounding flip of an intermediate at most
    for name, a, b in zip("qkw", got, ref, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert rel_err(a.astype(jnp.float32), b.astype(jnp.float32)) < tol, name
    assert got[2].dtype == jnp.float32 and got[0].dtype == dtype


@pytest.mark.slow
def test_reference_and_layer_kernel_path_match_the_modules(tiny_cfg):
    """The op's reference reproduces the layer's module-by-module prolog (q, k, w), and the layer's fused path
    (the kernel, asked for with use_pallas) matches it up to bf16 rounding flips."""
    cfg = tiny_cfg.replace(index_num_heads=16, index_head_dim=64, index_rope_dim=32)
    model = HybridLM(cfg, rngs=nnx.Rngs(5))
    layer = model.layers[cfg.layer_types.index("sparse")].self_attn
    b, t = 2, 3
    x = jax.random.normal(jax.random.key(1), (b, t, cfg.hidden_size), model.dtypes.compute)
    c_q = layer.q_a_layernorm(layer.q_a_proj(x)) if cfg.q_lora_rank else x
    positions = jnp.array([[5, 6, 7], [0, 1, 2]], jnp.int32)
    idx = layer.indexer
    steps = (
        idx._rope(idx.wq_b(c_q).reshape(b, t, 16, 64), positions),
        idx._rope(idx.k_norm(idx.wk(x)), positions),
        idx.weights_proj(x.astype(jnp.float32)) * 16**-0.5,
    )
    assert idx._fused_prolog(x, c_q, _Positions(positions)) is None  # CPU, no use_pallas: the modules
    with use_pallas(ops=["indexer_prolog"]):
        fused = idx._fused_prolog(x, c_q, _Positions(positions))
    assert fused is not None
    inv = inv_frequencies(32, cfg.rope_theta, cfg.rope_scaling)
    cos, sin = (a.reshape(b * t, -1) for a in rope_tables(positions, inv, attention_factor(cfg.rope_scaling)))
    ref = indexer_prolog(
        x.reshape(b * t, -1), c_q.reshape(b * t, -1), idx.wq_b.kernel[...], idx.wk.kernel[...],
        idx.k_norm.weight[...], idx.k_norm.bias[...], idx.weights_proj.kernel[...], cos, sin,
        num_heads=16, rope_dim=32, eps=cfg.index_norm_eps, impl="reference",
    )  # fmt: skip
    for name, a, r, s in zip("qkw", fused, ref, steps, strict=True):
        assert a.shape == s.shape and a.dtype == s.dtype == r.dtype, name
        s32 = np.asarray(s, np.float32)
        np.testing.assert_allclose(np.asarray(r, np.float32).reshape(s.shape), s32, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(a, np.float32), s32, rtol=2e-2, atol=2e-2)


class _Positions:  # the one StepInfo field the prolog reads
    def __init__(self, positions):
        self.positions = positions


def test_rule_and_errors(monkeypatch):
    assert api.prolog_supported(16, 1536, 7168, 64, 128, 64)  # DeepSeek-V3.2 decode at batch 16
    assert not api.prolog_supported(api.PROLOG_MAX_ROWS + 1, 1536, 7168, 64, 128, 64)  # prefill: cuBLAS
    assert not api.prolog_supported(1, 32, 64, 4, 32, 8)  # 4-wide column groups: no tensor-core tile
    args = _case(0, 2, 32, 16, 16, 64, 32)
    kw = dict(num_heads=16, rope_dim=32, eps=1e-6)
    jaxpr = lambda: str(jax.make_jaxpr(lambda *a: indexer_prolog(*a, **kw))(*args))  # noqa: E731
    assert "pallas_call" not in jaxpr()  # CPU: the reference
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert "pallas_call" not in jaxpr()  # GPU: opt-in (measured slower than XLA's kernels)
    with use_pallas(ops=["indexer_prolog"]):
        assert "name=indexer_prolog" in jaxpr()
    with pytest.raises(ValueError, match=r"wp.shape=\(32, 15\), expected \(32, 16\)"):
        indexer_prolog(*args[:6], args[6][:, :15], *args[7:], **kw)
    with pytest.raises(ValueError, match="rope_dim=3"):
        indexer_prolog(*args[:7], args[7][:, :1], args[8][:, :1], num_heads=16, rope_dim=3, eps=1e-6)
    with pytest.raises(ValueError, match="impl='triton'"):
        indexer_prolog(*args, impl="triton", **kw)
