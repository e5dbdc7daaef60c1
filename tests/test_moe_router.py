"""The Pallas MoE router kernel against the XLA routing reference: interpret mode on the CPU, the compiled
kernel where a GPU is present (`interpret=None`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import use_pallas
from pallas_kernels.moe import moe_route
from pallas_kernels.moe.tuning import ROUTER_MAX_ROWS
from tests.conftest import examples


def _inputs(seed, n, d, e, dtype=jnp.bfloat16):
    ks = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(ks[0], (n, d), dtype)
    w = (jax.random.normal(ks[1], (d, e)) * d**-0.5).astype(dtype)
    bias = jax.random.uniform(ks[2], (e,), jnp.float32, -0.05, 0.05)
    return x, w, bias


@settings(max_examples=examples(8), deadline=None)
@given(
    seed=st.integers(0, 2**16),
    n=st.sampled_from([1, 3, 16]),
    d=st.sampled_from([48, 256, 2304]),
    e=st.sampled_from([16, 32, 64, 48, 288]),  # 48 and 288 (GLM-5.3-Flash): padded to a power of two
    k=st.sampled_from([1, 6, 8]),
    scoring=st.sampled_from(["sigmoid", "softmax"]),
    norm=st.booleans(),
)
def test_router_kernel_matches_reference(seed, n, d, e, k, scoring, norm):
    x, w, bias = _inputs(seed, n, d, e)
    kw = dict(k=k, scoring=scoring, norm_topk_prob=norm, scaling=2.5)
    w_ref, id_ref = moe_route(x, w, bias, impl="reference", **kw)
    w_ker, id_ker = moe_route(x, w, bias, impl="pallas", interpret=None, **kw)
    assert id_ker.shape == (n, k) and id_ker.dtype == jnp.int32 and w_ker.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(id_ker), np.asarray(id_ref))  # same experts, same order
    np.testing.assert_allclose(np.asarray(w_ker), np.asarray(w_ref), rtol=1e-5, atol=1e-7)


def test_router_kernel_breaks_ties_to_the_lower_expert():
    """Experts 2 and 9 have the same router column and bias: equal scores, the lower id first in both."""
    x, w, bias = _inputs(4, 2, 64, 16)
    w = w.at[:, 9].set(w[:, 2])
    bias = bias.at[9].set(bias[2]) + 10.0 * (jnp.arange(16) % 7 == 2)  # both far above the rest
    kw = dict(k=3, scoring="sigmoid", norm_topk_prob=True, scaling=1.0)
    _, id_ref = moe_route(x, w, bias, impl="reference", **kw)
    _, id_ker = moe_route(x, w, bias, impl="pallas", interpret=None, **kw)
    assert np.asarray(id_ker)[:, :2].tolist() == [[2, 9], [2, 9]]
    np.testing.assert_array_equal(np.asarray(id_ker), np.asarray(id_ref))


def test_router_auto_choice_and_errors(monkeypatch):
    x, w, bias = _inputs(0, 1, 64, 32)
    kw = dict(k=4)

    def traced(x, w, n_group=1):
        fn = lambda x, w, b: moe_route(x, w, b, n_group=n_group, interpret=True, **kw)  # noqa: E731
        return str(jax.make_jaxpr(fn)(x, w, bias))

    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert "moe_router" not in traced(x, w)  # CPU: the reference
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert "moe_router" in traced(x, w)  # one decoded token on a GPU
    big = jnp.ones((ROUTER_MAX_ROWS + 1, 64), x.dtype)
    assert "moe_router" not in traced(big, w)  # prefill: XLA's batched product and top-k
    assert "moe_router" not in traced(x, w, n_group=2)  # grouped selection: the reference
    assert "moe_router" not in traced(x.astype(jnp.float32), w.astype(jnp.float32))  # float32 router
    with use_pallas(ops=["moe_router"]):
        assert "moe_router" in traced(x, w)
        assert "moe_router" not in traced(big, w)  # beyond the GEMV's 16 rows
    with pytest.raises(ValueError, match="impl='triton'"):
        moe_route(x, w, bias, impl="triton", **kw)
    with pytest.raises(ValueError, match="k=33"):
        moe_route(x, w, bias, k=33)
    with pytest.raises(ValueError, match=r"bias=\(31,\)"):
        moe_route(x, w, bias[:31], **kw)
    with pytest.raises(ValueError, match="at most 16 tokens \\(got 17\\)"):
        moe_route(big, w, bias, impl="pallas", **kw)
    with pytest.raises(ValueError, match="n_group=1 \\(got 2\\)"):
        moe_route(x, w, bias, n_group=2, impl="pallas", **kw)
    x24, w24, b24 = _inputs(0, 1, 64, 24)
    with pytest.raises(ValueError, match="got 24"):  # E not a multiple of the GEMV's 16-column tiles
        moe_route(x24, w24, b24, impl="pallas", **kw)


def test_router_kernel_288_experts_all_selectable():
    """GLM-5.3-Flash's 288 experts: the kernel pads its selection to 512; experts past 256 get picked (a bias
    that favours them) and a padded slot never is, even with k = 288 (every real expert)."""
    x, w, bias = _inputs(7, 3, 128, 288)
    bias = bias + 5.0 * (jnp.arange(288) >= 280)
    for k in (8, 288):
        kw = dict(k=k, scoring="sigmoid", norm_topk_prob=True, scaling=2.5)
        w_ref, id_ref = moe_route(x, w, bias, impl="reference", **kw)
        w_ker, id_ker = moe_route(x, w, bias, impl="pallas", interpret=None, **kw)
        np.testing.assert_array_equal(np.asarray(id_ker), np.asarray(id_ref))
        np.testing.assert_allclose(np.asarray(w_ker), np.asarray(w_ref), rtol=1e-5, atol=1e-7)
        assert set(np.asarray(id_ker)[:, :8].ravel()) <= set(range(280, 288))


@pytest.mark.slow
def test_model_decode_step_through_router_kernel(tiny_cfg):
    """A bf16 model's decode step with the router kernel forced: the same logits as with XLA's routing."""
    from flax import nnx

    from hybrid_jax import HybridLM
    from tests.conftest import rel_err

    cfg = tiny_cfg.replace(num_experts=16, num_experts_per_tok=4, n_group=1, topk_group=1)
    model = HybridLM(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(3), (2, 5), 0, cfg.vocab_size)
    _, cache = jax.jit(lambda m, i, c: m.prefill(i, c))(model, ids, model.init_cache(2, 16))

    def step():  # a fresh trace: use_pallas() is read at trace time
        fn = lambda m, i, c: m.decode_step(i, c)[0]  # noqa: E731
        return str(jax.make_jaxpr(fn)(model, ids[:, -1], cache)), jax.jit(fn)(model, ids[:, -1], cache)

    with use_pallas(False, ops=["moe_router"]):  # XLA's routing on any backend (a GPU's default is the kernel)
        text, xla = step()
    assert "moe_router" not in text
    with use_pallas(ops=["moe_router"]):
        text, kernel = step()
    assert "name=moe_router" in text
    assert rel_err(kernel, xla) < 1e-5


def test_record_router_records_each_moe_layers_routing(tiny_model, monkeypatch):
    """`hybrid_jax.inspect.record_router`: one record per MoE layer call, in order, holding what the layer's
    router returned (checked against a wrapper around it), [B*T, k]; nothing outside the block; under jit it
    refuses tracers unless entered inside the traced function with traced=True."""
    from hybrid_jax.inspect import record_router
    from hybrid_jax.layers import moe as moe_layer

    cfg = tiny_model.config
    ids = jax.random.randint(jax.random.key(5), (2, 7), 0, cfg.vocab_size)
    returned, route = [], moe_layer.moe_route

    def wrapped(*a, **kw):
        w, idx = route(*a, **kw)
        returned.append((np.asarray(w), np.asarray(idx)))
        return w, idx

    monkeypatch.setattr(moe_layer, "moe_route", wrapped)
    with record_router() as routes:
        logits = tiny_model(ids)
    monkeypatch.setattr(moe_layer, "moe_route", route)
    layers, k = cfg.mlp_types.count("moe"), cfg.num_experts_per_tok
    assert len(routes) == len(returned) == layers > 0
    for r, (w, idx) in zip(routes, returned, strict=True):
        assert r["indices"].shape == r["weights"].shape == (2 * 7, k)
        np.testing.assert_array_equal(r["indices"], idx)
        np.testing.assert_array_equal(r["weights"], w)
        assert ((idx >= 0) & (idx < cfg.num_experts)).all()
    assert len({tuple(r["indices"].ravel()) for r in routes}) > 1  # the layers route differently
    with record_router() as closed:
        tiny_model(ids)
    tiny_model(ids)  # after the block: its list takes no more records
    assert len(closed) == layers
    with pytest.raises(RuntimeError, match=r"record_router\(\) records eager calls only"):
        with record_router():
            jax.jit(lambda m, i: m(i))(tiny_model, ids)

    def traced(m, i):  # inside the trace: the records are this function's arrays, to compute with
        with record_router(traced=True) as inside:
            m(i)
        return jnp.stack([r["indices"] for r in inside])

    np.testing.assert_array_equal(jax.jit(traced)(tiny_model, ids), np.stack([r["indices"] for r in routes]))
    assert np.isfinite(np.asarray(logits, np.float32)).all()
