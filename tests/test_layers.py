"""Routing, grouped experts, RoPE / YaRN and the short convolution against independent numpy code."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_jax import HybridConfig
from hybrid_jax.layers.common import DTypes
from hybrid_jax.layers.moe import MoE, route
from hybrid_jax.layers.rope import apply_rope, inv_frequencies
from pallas_kernels.moe import moe_experts
from tests.conftest import rel_err


def _route_numpy(logits, bias, cfg):
    if cfg.scoring_func == "sigmoid":
        s = 1 / (1 + np.exp(-logits))
    else:
        s = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    choice = s + bias
    n, e = choice.shape
    per = e // cfg.n_group
    ws, ids = [], []
    for i in range(n):
        gs = [np.sort(choice[i, g * per : (g + 1) * per])[-2:].sum() for g in range(cfg.n_group)]
        keep = np.argsort(-np.asarray(gs), kind="stable")[: cfg.topk_group]
        c = np.full(e, -np.inf)
        for g in keep:
            c[g * per : (g + 1) * per] = choice[i, g * per : (g + 1) * per]
        top = np.argsort(-c, kind="stable")[: cfg.num_experts_per_tok]
        w = s[i, top]
        if cfg.norm_topk_prob:
            w = w / (w.sum() + 1e-20)
        ws.append(w * cfg.routed_scaling_factor)
        ids.append(top)
    return np.array(ws), np.array(ids)


@pytest.mark.parametrize("n_group,topk_group,scoring", [(2, 1, "sigmoid"), (4, 2, "sigmoid"), (1, 1, "softmax")])
def test_route_matches_numpy(n_group, topk_group, scoring):
    cfg = HybridConfig.tiny().replace(
        n_group=n_group, topk_group=topk_group, scoring_func=scoring, num_experts_per_tok=2
    )
    logits = jax.random.normal(jax.random.key(0), (32, 8))
    bias = jax.random.normal(jax.random.key(1), (8,)) * 0.1
    w, idx = route(logits, bias, cfg)
    w_ref, idx_ref = _route_numpy(np.asarray(logits, np.float64), np.asarray(bias, np.float64), cfg)
    # top_k order is by biased score; compare as sets per token, with matching weights
    for i in range(32):
        got = dict(zip(np.asarray(idx[i]).tolist(), np.asarray(w[i]).tolist(), strict=True))
        ref = dict(zip(idx_ref[i].tolist(), w_ref[i].tolist(), strict=True))
        assert got.keys() == ref.keys()
        np.testing.assert_allclose([got[j] for j in ref], list(ref.values()), rtol=1e-5)


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_grouped_experts_equal_per_token_loop(impl):
    n, d, f, e, k = 19, 8, 6, 5, 3
    ks = jax.random.split(jax.random.key(2), 5)
    x = jax.random.normal(ks[0], (n, d))
    gate, up = jax.random.normal(ks[1], (e, d, f)), jax.random.normal(ks[2], (e, d, f))
    down = jax.random.normal(ks[3], (e, f, d))
    idx = jnp.asarray(np.stack([np.random.default_rng(i).permutation(e)[:k] for i in range(n)]), jnp.int32)
    w = jax.random.uniform(ks[4], (n, k))
    out = moe_experts(x, idx, w, gate, up, down, impl=impl, block_m=16, block_n=16, block_k=16, precision="ieee")
    xn, gn, un, dn = (np.asarray(a, np.float64) for a in (x, gate, up, down))
    ref = np.zeros((n, d))
    for i in range(n):
        for j in range(k):
            ex = int(idx[i, j])
            a = xn[i] @ gn[ex]
            ref[i] += float(w[i, j]) * ((a / (1 + np.exp(-a)) * (xn[i] @ un[ex])) @ dn[ex])
    assert rel_err(out, ref) < 1e-5


def test_moe_layer_equals_dense_mixture():
    cfg = HybridConfig.tiny()
    moe = MoE(cfg, DTypes(), rngs=nnx.Rngs(3))
    x = jax.random.normal(jax.random.key(4), (2, 5, cfg.hidden_size))
    y = moe(x)
    x2 = np.asarray(x, np.float64).reshape(-1, cfg.hidden_size)
    w, idx = _route_numpy(
        x2 @ np.asarray(moe.gate.kernel[...], np.float64),
        np.asarray(moe.gate.e_score_correction_bias[...], np.float64),
        cfg,
    )
    silu = lambda a: a / (1 + np.exp(-a))
    g, u, dn = (
        np.asarray(p[...], np.float64) for p in (moe.experts.gate_proj, moe.experts.up_proj, moe.experts.down_proj)
    )
    ref = np.zeros_like(x2)
    for i in range(x2.shape[0]):
        for wk, e in zip(w[i], idx[i], strict=True):
            ref[i] += wk * ((silu(x2[i] @ g[e]) * (x2[i] @ u[e])) @ dn[e])
    sh = moe.shared_experts
    ref += (silu(x2 @ np.asarray(sh.gate_proj.kernel[...])) * (x2 @ np.asarray(sh.up_proj.kernel[...]))) @ np.asarray(
        sh.down_proj.kernel[...]
    )
    assert rel_err(y.reshape(x2.shape), ref) < 1e-5


def test_deepseek_yarn_frequencies():
    """ARCH_SPEC §3.2: dim 64, theta 1e4, factor 40, original 4096 -> ramp from dim-pair 10 to 23."""
    cfg = HybridConfig.deepseek_v32()
    inv = inv_frequencies(64, cfg.rope_theta, cfg.rope_scaling)
    base = 1.0 / 10000 ** (np.arange(0, 64, 2) / 64)
    s = 1 - np.clip((np.arange(32) - 10) / (23 - 10), 0, 1)
    np.testing.assert_allclose(inv, base / 40 * (1 - s) + base * s, rtol=1e-6)
    assert 0.1 * math.log(40) + 1 == pytest.approx(1.36889, abs=1e-5)


def test_rope_is_relative_and_interleaving_is_a_permutation():
    inv = inv_frequencies(16, 10000.0, None)
    q, k = jax.random.normal(jax.random.key(5), (2, 1, 1, 16))
    for interleaved in (True, False):

        def rot(x, p, il=interleaved):
            return apply_rope(x, jnp.array([[p]]), inv, interleaved=il)

        d1 = float(jnp.sum(rot(q, 7) * rot(k, 3)))
        d2 = float(jnp.sum(rot(q, 104) * rot(k, 100)))
        assert d1 == pytest.approx(d2, rel=1e-4)
    perm = np.concatenate([np.arange(0, 16, 2), np.arange(1, 16, 2)])  # [evens | odds], HF rope_interleave
    a = apply_rope(q, jnp.array([[5]]), inv, interleaved=True)[..., perm]
    b = apply_rope(q[..., perm], jnp.array([[5]]), inv, interleaved=False)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
