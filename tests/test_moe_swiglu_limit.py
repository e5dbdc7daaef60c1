"""The clamped SwiGLU (GLM-5.3-Flash): with a limit L every expert computes
    gate ← min(gate, L),  up ← clip(up, −L, L),  h = SiLU(gate) ⊙ up,  y = down(h).
The float32 reference against independent numpy; every form of `moe_experts` (gather, the grouped kernel, the
GEMV kernels with and without the fused shared expert) against the reference on awkward shapes where the clamp
bites; the dense SwiGLU and the MoE layer; limit=None as the plain program; the argument check."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_jax import HybridConfig
from hybrid_jax.layers.common import DTypes, SwiGLU
from hybrid_jax.layers.moe import MoE
from pallas_kernels import use_pallas
from pallas_kernels.moe import api, gemv, kernel, moe_experts
from pallas_kernels.moe.reference import moe_experts_reference, swiglu_reference
from tests.conftest import examples, rel_err

SCALE = 1.5  # std of the gate / up products: limits of 0.4-0.7 clamp a good share of them on every side


def _case(seed, n, d, f, e, k, skew, fs=None, dtype=jnp.float32):
    """x [n, d], idx / w [n, k] (distinct experts per token; skew crowds tokens onto few experts), gate / up
    [e, d, f], down [e, f, d]; with fs also a shared expert's (gate [d, fs], up [d, fs], down [fs, d])."""
    ks = jax.random.split(jax.random.key(seed), 9)
    x = jax.random.normal(ks[0], (n, d))
    logits = jax.random.normal(ks[1], (n, e)) - skew * jnp.arange(e)[None, :]
    idx = jax.lax.top_k(logits, k)[1].astype(jnp.int32)
    w = jax.nn.softmax(jax.random.normal(ks[2], (n, k)), axis=-1)
    gate, up = (jax.random.normal(kk, (e, d, f)) * SCALE * d**-0.5 for kk in ks[3:5])
    down = jax.random.normal(ks[5], (e, f, d)) * f**-0.5
    cast = lambda *a: tuple(b.astype(dtype) for b in a)  # noqa: E731
    args = (cast(x)[0], idx, w, *cast(gate, up, down))
    if fs is None:
        return args, None
    shapes = [(d, fs), (d, fs), (fs, d)]
    scales = [SCALE * d**-0.5, SCALE * d**-0.5, fs**-0.5]
    shared = tuple(jax.random.normal(kk, s) * c for kk, s, c in zip(ks[6:], shapes, scales, strict=True))
    return args, cast(*shared)


def _products(x, idx, gate, up, shared=None):
    """The float64 gate and up products of every routed pair (and of the shared expert for every token)."""
    xn = np.asarray(x, np.float64)
    ids = np.asarray(idx)
    g = np.einsum("nd,nkdf->nkf", xn, np.asarray(gate, np.float64)[ids]).ravel()
    u = np.einsum("nd,nkdf->nkf", xn, np.asarray(up, np.float64)[ids]).ravel()
    if shared is not None:
        g = np.concatenate([g, (xn @ np.asarray(shared[0], np.float64)).ravel()])
        u = np.concatenate([u, (xn @ np.asarray(shared[1], np.float64)).ravel()])
    return g, u


def _assert_bites(x, idx, gate, up, limit, shared=None):
    """The clamp changes this case: some gate products above L, some up products above L and below −L (and
    some gate products below −L, which a two-sided gate clamp would wrongly move)."""
    g, u = _products(x, idx, gate, up, shared)
    assert (g > limit).any() and (g < -limit).any(), "no gate product beyond ±L: the clamp would not bite"
    assert (u > limit).any() and (u < -limit).any(), "no up product outside [−L, L]: the clamp would not bite"
    if shared is not None:  # the shared expert's own products too (it is clamped in its own code path)
        _assert_bites(x, jnp.zeros((x.shape[0], 1), jnp.int32), shared[0][None], shared[1][None], limit)


def _numpy_experts(x, idx, w, gate, up, down, limit, shared=None, two_sided_gate=False):
    """Σ_j w_j E_j(x) in float64, E(x) = down(SiLU(min(gate x, L)) ⊙ clip(up x, ±L)) (+ the shared expert)."""
    xn, gn, un, dn = (np.asarray(a, np.float64) for a in (x, gate, up, down))

    def expert(xr, wg, wu, wd):
        g, u = xr @ wg, xr @ wu
        if limit is not None:
            g = np.clip(g, -limit, limit) if two_sided_gate else np.minimum(g, limit)
            u = np.clip(u, -limit, limit)
        return (g / (1 + np.exp(-g)) * u) @ wd

    out = np.zeros_like(xn)
    for t in range(xn.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            out[t] += float(w[t, j]) * expert(xn[t], gn[e], un[e], dn[e])
        if shared is not None:
            out[t] += expert(xn[t], *(np.asarray(a, np.float64) for a in shared))
    return out


def test_reference_clamps_gate_above_and_up_on_both_sides():
    """The ground truth against independent float64 numpy, routed and shared experts: the gate clamped from
    above only (a two-sided gate clamp is far off), up on both sides; and the clamp really changes the sum."""
    limit = 0.5
    (x, idx, w, gate, up, down), shared = _case(1, 13, 40, 24, 9, 3, 1.0, fs=20)
    _assert_bites(x, idx, gate, up, limit, shared)
    got = moe_experts(x, idx, w, gate, up, down, impl="reference", swiglu_limit=limit, shared=shared)
    want = _numpy_experts(x, idx, w, gate, up, down, limit, shared)
    assert rel_err(got, want) < 1e-5
    assert rel_err(got, _numpy_experts(x, idx, w, gate, up, down, limit, shared, two_sided_gate=True)) > 1e-2
    assert rel_err(got, _numpy_experts(x, idx, w, gate, up, down, None, shared)) > 1e-1
    blocked = moe_experts_reference(x, idx, w, gate, up, down, budget=5000, swiglu_limit=limit)  # token blocks
    assert rel_err(blocked, moe_experts(x, idx, w, gate, up, down, impl="reference", swiglu_limit=limit)) < 1e-6


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gather_form_clamps_like_reference(dtype):
    limit = 0.6
    (x, idx, w, gate, up, down), _ = _case(2, 5, 72, 40, 13, 3, 3.0, dtype=dtype)
    _assert_bites(x, idx, gate, up, limit)
    ref = moe_experts(x, idx, w, gate, up, down, impl="reference", swiglu_limit=limit)
    got = moe_experts(x, idx, w, gate, up, down, impl="reference", form="gather", swiglu_limit=limit)
    assert rel_err(got, ref) < (1e-5 if dtype == jnp.float32 else 1e-2)


@settings(max_examples=examples(4), deadline=None)
@given(
    seed=st.integers(0, 2**16),
    n=st.sampled_from([1, 3, 7, 13, 37]),
    d=st.sampled_from([24, 40, 72]),  # padded to whole contraction / output tiles
    f=st.sampled_from([24, 40, 48]),
    e=st.sampled_from([5, 9, 13]),
    k=st.integers(1, 3),
    skew=st.sampled_from([0.0, 3.0]),
    block_m=st.sampled_from([16, 32]),
    limit=st.sampled_from([0.4, 0.7]),
)
def test_grouped_kernel_clamps_like_reference(seed, n, d, f, e, k, skew, block_m, limit):
    (x, idx, w, gate, up, down), _ = _case(seed, n, d, f, e, k, skew)
    _assert_bites(x, idx, gate, up, limit)
    ref = moe_experts(x, idx, w, gate, up, down, impl="reference", swiglu_limit=limit)
    got = moe_experts(
        x, idx, w, gate, up, down, impl="pallas", form="grouped", block_m=block_m, block_n=16, block_k=16,
        precision="ieee", interpret=True, swiglu_limit=limit,
    )  # fmt: skip
    assert got.shape == ref.shape and got.dtype == jnp.float32
    assert rel_err(got, ref) < 1e-5


@settings(max_examples=examples(4), deadline=None)
@given(
    seed=st.integers(0, 2**16),
    n=st.sampled_from([1, 2, 3, 5]),
    d=st.sampled_from([24, 40, 72]),
    f=st.sampled_from([24, 40, 48]),
    e=st.sampled_from([5, 9, 13]),
    k=st.integers(1, 3),
    skew=st.sampled_from([0.0, 3.0]),
    split_k=st.sampled_from([None, 1, 2, 4]),
    shared=st.sampled_from([None, "fused", "xla"]),  # fused: Fs = F, one more program row per token
    limit=st.sampled_from([0.4, 0.7]),
)
def test_gemv_kernels_clamp_like_reference(seed, n, d, f, e, k, skew, split_k, shared, limit):
    fs = {None: None, "fused": f, "xla": f + 8}[shared]
    (x, idx, w, gate, up, down), sh = _case(seed, n, d, f, e, k, skew, fs=fs)
    _assert_bites(x, idx, gate, up, limit, sh)
    ref = moe_experts(x, idx, w, gate, up, down, impl="reference", shared=sh, swiglu_limit=limit)
    run = lambda *a: moe_experts(  # noqa: E731
        *a, impl="pallas", form="gemv", block_n=16, block_k=16, split_k=split_k, interpret=True, shared=sh,
        swiglu_limit=limit,
    )  # fmt: skip
    got = run(x, idx, w, gate, up, down)
    assert got.shape == ref.shape and got.dtype == jnp.float32
    assert rel_err(got, ref) < 1e-5
    if shared == "fused":  # the shared expert really ran inside the two launches
        assert str(jax.make_jaxpr(run)(x, idx, w, gate, up, down)).count("pallas_call") == 2


@pytest.mark.parametrize("mma", [True, False])
@pytest.mark.parametrize("fused_shared", [False, True])
def test_gemv_kernels_clamp_bf16(mma, fused_shared):
    """bf16 rows, the tensor-core and the CUDA-core kernels: the clamp on the float32 sums, h rounded to bf16
    after it, as the reference does."""
    limit = 0.5
    (x, idx, w, gate, up, down), sh = _case(4, 3, 72, 40, 9, 3, 3.0, fs=40 if fused_shared else None,
                                            dtype=jnp.bfloat16)  # fmt: skip
    _assert_bites(x, idx, gate, up, limit, sh)
    ref = moe_experts(x, idx, w, gate, up, down, impl="reference", shared=sh, swiglu_limit=limit)
    got = api._experts_gemv(x, idx, w, gate, up, down, 16, 16, None, True, sh, mma=mma, limit=limit)
    assert rel_err(got, ref) < 1e-2
    assert rel_err(got, moe_experts(x, idx, w, gate, up, down, impl="reference", shared=sh)) > 1e-1


def test_grouped_kernel_clamps_bf16_with_shared_expert():
    limit = 0.5
    (x, idx, w, gate, up, down), sh = _case(5, 21, 40, 24, 7, 2, 0.0, fs=24, dtype=jnp.bfloat16)
    _assert_bites(x, idx, gate, up, limit, sh)
    ref = moe_experts(x, idx, w, gate, up, down, impl="reference", shared=sh, swiglu_limit=limit)
    got = moe_experts(
        x, idx, w, gate, up, down, impl="pallas", precision="ieee", interpret=True, shared=sh, swiglu_limit=limit
    )
    assert rel_err(got, ref) < 1e-2


def test_gate_up_gemv_epilogue_clamps():
    """`gate_up_gemv` returning h (not partials) clamps in its epilogue; partials refuse a limit (the down
    kernel clamps them), as does `down_gemv` given a formed h."""
    limit = 0.5
    ks = jax.random.split(jax.random.key(9), 3)
    e_ids = jnp.array([2, 0, 2], jnp.int32)
    x = jax.random.normal(ks[0], (3, 48))
    gate, up = (jax.random.normal(k, (4, 48, 32)) * SCALE * 48**-0.5 for k in ks[1:])
    kw = dict(block_n=16, block_k=16, split_k=3, mma=False, interpret=True)
    h = gemv.gate_up_gemv(e_ids, x, gate, up, swiglu_limit=limit, **kw)
    g = np.einsum("pd,pdf->pf", np.asarray(x, np.float64), np.asarray(gate, np.float64)[np.asarray(e_ids)])
    u = np.einsum("pd,pdf->pf", np.asarray(x, np.float64), np.asarray(up, np.float64)[np.asarray(e_ids)])
    assert (g > limit).any() and (u > limit).any() and (u < -limit).any()
    g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
    assert rel_err(h, g / (1 + np.exp(-g)) * u) < 1e-5
    with pytest.raises(ValueError, match="partials"):
        gemv.gate_up_gemv(e_ids, x, gate, up, swiglu_limit=limit, partials=True, **kw)
    with pytest.raises(ValueError, match="formed h"):
        gemv.down_gemv(e_ids, h, jnp.ones((4, 32, 16)), swiglu_limit=limit, **kw)


_FORMS = {
    "ragged_dot": (dict(impl="reference"), False, 1),
    "gather": (dict(impl="reference", form="gather"), False, 1),
    "grouped": (dict(impl="pallas", form="grouped", block_n=16, block_k=16), False, 1),
    "grouped+shared": (dict(impl="pallas", form="grouped", block_n=16, block_k=16), True, 2),
    "gemv": (dict(impl="pallas", form="gemv", block_n=16, block_k=16), False, 1),
    "gemv+fused shared": (dict(impl="pallas", form="gemv", block_n=16, block_k=16), True, 2),
}


@pytest.mark.parametrize("name", list(_FORMS))
def test_no_limit_is_the_plain_program(name):
    """limit=None traces the program of a call without the argument, and a limit adds exactly the clamp — two
    `min` and one `max` per place SiLU(gate) ⊙ up is formed (a kernel with the shared expert fused forms it in
    two branches; a separate shared expert is one more place) — and nothing else. A limit no product reaches
    gives bit-identical values (the clamp sits on the float32 products); a limit that bites changes them."""
    kw, with_shared, sites = _FORMS[name]
    (x, idx, w, gate, up, down), sh = _case(6, 3, 40, 24, 9, 2, 0.0, fs=24 if with_shared else None)
    args = (x, idx, w, gate, up, down)

    def jaxpr(**extra):
        return str(jax.make_jaxpr(lambda *a: moe_experts(*a, interpret=True, shared=sh, **kw, **extra))(*args))

    plain, none, limited = jaxpr(), jaxpr(swiglu_limit=None), jaxpr(swiglu_limit=0.75)
    assert none == plain

    def count(text, op):
        return len(re.findall(rf"= {op} ", text))

    assert count(limited, "min") - count(plain, "min") == 2 * sites
    assert count(limited, "max") - count(plain, "max") == sites
    assert len(limited.splitlines()) == len(plain.splitlines()) + 3 * sites  # no other equation

    run = lambda **extra: np.asarray(moe_experts(*args, interpret=True, shared=sh, **kw, **extra))  # noqa: E731
    base = run()
    assert np.array_equal(run(swiglu_limit=None), base)
    assert np.array_equal(run(swiglu_limit=1e30), base)  # never reached: bit-identical
    assert rel_err(run(swiglu_limit=0.5), base) > 1e-2


def test_no_limit_reference_is_plain_swiglu_bit_for_bit():
    """The reference without a limit is the plain SwiGLU's grouped matmuls, bit for bit."""
    (x, idx, w, gate, up, down), _ = _case(7, 11, 40, 24, 9, 3, 1.0)
    order = jnp.argsort(idx.reshape(-1), stable=True)
    sizes = jnp.bincount(idx.reshape(-1), length=9).astype(jnp.int32)
    xs = x[order // 3]
    g = jax.lax.ragged_dot(xs, gate, sizes, preferred_element_type=jnp.float32)
    u = jax.lax.ragged_dot(xs, up, sizes, preferred_element_type=jnp.float32)
    y = jax.lax.ragged_dot(jax.nn.silu(g) * u, down, sizes, preferred_element_type=jnp.float32)
    back = jnp.argsort(order)  # each pair's sorted row: every token's 3 rows summed in their own order
    want = jnp.sum((y * w.reshape(-1)[order][:, None])[back].reshape(11, 3, -1), axis=1)
    got = moe_experts(x, idx, w, gate, up, down, impl="reference", swiglu_limit=None)
    assert np.array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, -math.inf, math.inf, math.nan, True, "7"])
def test_bad_limits_are_refused(bad):
    (x, idx, w, gate, up, down), sh = _case(8, 2, 16, 16, 4, 2, 0.0, fs=16)
    named = re.escape(f"swiglu_limit={bad!r}")
    for kw in (dict(impl="reference"), dict(impl="pallas", form="gemv"), dict(impl="pallas", form="grouped")):
        with pytest.raises(ValueError, match=named):
            moe_experts(x, idx, w, gate, up, down, interpret=True, swiglu_limit=bad, **kw)
    with pytest.raises(ValueError, match=named):
        swiglu_reference(x, *sh, swiglu_limit=bad)
    with pytest.raises(ValueError, match=named):
        kernel.grouped_gate_up_pallas(
            x, jnp.zeros((16,), jnp.int32), gate, up, jnp.zeros((1,), jnp.int32), block_m=16, block_n=16,
            block_k=16, interpret=True, swiglu_limit=bad,
        )  # fmt: skip
    with pytest.raises(ValueError, match=re.escape(f"limit={bad!r}")):
        SwiGLU(16, 24, DTypes(), nnx.Rngs(0), limit=bad)


def test_dense_swiglu_clamps():
    limit = 0.03  # the random layer's products are small (weights of std 0.02)
    mlp = SwiGLU(64, 96, DTypes(), nnx.Rngs(1), limit=limit)
    plain = SwiGLU(64, 96, DTypes(), nnx.Rngs(1))
    x = jax.random.normal(jax.random.key(2), (2, 5, 64))
    wg, wu, wd = (np.asarray(p.kernel[...], np.float64) for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    xn = np.asarray(x, np.float64)
    g, u = xn @ wg, xn @ wu
    assert (g > limit).any() and (g < -limit).any() and (u > limit).any() and (u < -limit).any()
    gc, uc = np.minimum(g, limit), np.clip(u, -limit, limit)
    assert rel_err(mlp(x), (gc / (1 + np.exp(-gc)) * uc) @ wd) < 1e-5
    assert rel_err(plain(x), (g / (1 + np.exp(-g)) * u) @ wd) < 1e-5
    assert rel_err(mlp(x), plain(x)) > 1e-2
    assert mlp.limit == limit and plain.limit is None


@pytest.mark.parametrize("kernels", [False, True])
def test_moe_layer_passes_the_limit_to_routed_and_shared_experts(kernels):
    """`MoE` with `cfg.swiglu_limit`: its routed experts and its shared expert clamp (the reference on the CPU,
    and the grouped kernel inside `use_pallas`), against the layer's weights through the reference."""
    limit = 0.02
    cfg = HybridConfig.tiny().replace(swiglu_limit=limit)
    moe = MoE(cfg, DTypes(), rngs=nnx.Rngs(3))
    assert moe.shared_experts.limit == limit
    x = jax.random.normal(jax.random.key(4), (2, 5, cfg.hidden_size))
    if kernels:
        with use_pallas(ops=["moe"]):
            text = str(jax.make_jaxpr(lambda m, a: m(a))(moe, x))
            y = moe(x)
        assert "name=moe_gate_up" in text
    else:
        y = moe(x)
    x2 = x.reshape(-1, cfg.hidden_size)
    from pallas_kernels.moe import moe_route

    w, idx = moe_route(x2, moe.gate.kernel[...], moe.gate.e_score_correction_bias[...], impl="reference",
                       k=cfg.num_experts_per_tok, n_group=cfg.n_group, topk_group=cfg.topk_group,
                       scoring=cfg.scoring_func, norm_topk_prob=cfg.norm_topk_prob,
                       scaling=cfg.routed_scaling_factor)  # fmt: skip
    ex, sh = moe.experts, moe.shared_experts
    weights = (ex.gate_proj[...], ex.up_proj[...], ex.down_proj[...])
    shared = tuple(p.kernel[...] for p in (sh.gate_proj, sh.up_proj, sh.down_proj))
    _assert_bites(x2, idx, weights[0], weights[1], limit, shared)
    want = _numpy_experts(x2, idx, w, *weights, limit, shared)
    assert rel_err(y.reshape(x2.shape), want) < 1e-5
    assert rel_err(y.reshape(x2.shape), _numpy_experts(x2, idx, w, *weights, None, shared)) > 1e-2
