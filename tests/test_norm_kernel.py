"""The Pallas RMSNorm (+ residual) kernel (interpret mode on CPU) against its jnp reference, and the model
through it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import use_pallas
from pallas_kernels.norm import rms_norm
from tests.conftest import examples, rel_err


@settings(max_examples=examples(8), deadline=None)
@given(
    seed=st.integers(0, 2**16),
    rows=st.sampled_from([1, 3, 16]),
    d=st.sampled_from([48, 1024, 2304]),
    with_residual=st.booleans(),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
)
def test_rms_norm_kernel_matches_reference(seed, rows, d, with_residual, dtype):
    ks = jax.random.split(jax.random.key(seed), 3)
    x = (jax.random.normal(ks[0], (rows, 1, d)) * 3.0).astype(dtype)
    res = jax.random.normal(ks[1], (rows, 1, d)).astype(dtype) if with_residual else None
    w = 1.0 + 0.1 * jax.random.normal(ks[2], (d,))
    h_ref, y_ref = rms_norm(x, w, eps=1e-6, residual=res, impl="reference")
    h, y = rms_norm(x, w, eps=1e-6, residual=res, impl="pallas", interpret=True)
    assert h.dtype == dtype and y.dtype == dtype and y.shape == x.shape
    np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(h_ref, np.float32))  # the same adds
    assert rel_err(y, y_ref) < (1e-6 if dtype == jnp.float32 else 8e-3)  # bf16: a rounding flip at most


def test_rms_norm_errors_and_auto():
    x = jnp.ones((2, 64), jnp.bfloat16)
    w = jnp.ones((64,))
    with pytest.raises(ValueError, match="impl='cuda'"):
        rms_norm(x, w, eps=1e-6, impl="cuda")
    with pytest.raises(ValueError, match=r"weight \(32,\) must be \[64\]"):
        rms_norm(x, w[:32], eps=1e-6)
    with pytest.raises(ValueError, match=r"at most 16 rows.*\(17, 64\)"):
        rms_norm(jnp.ones((17, 64)), w, eps=1e-6, impl="pallas")

    def traced(x):  # a fresh function each time: use_pallas() is read at trace time
        return str(jax.make_jaxpr(lambda x: rms_norm(x, w, eps=1e-6, interpret=True))(x))

    assert "rms_norm" not in traced(x)  # opt-in: measured slower than XLA on the H200
    with use_pallas(ops=["rms_norm"]):
        assert "name=rms_norm" in traced(x)
        assert "name=rms_norm" not in traced(jnp.ones((17, 64)))  # prefill-sized: XLA


@pytest.mark.slow
def test_model_decode_through_norm_kernel(tiny_cfg):
    """A bf16 model's decode steps with the norm kernel forced (every RMSNorm at decode, the post-attention
    norm with its residual add): the logits of XLA's norms up to bf16 rounding."""
    from flax import nnx

    from hybrid_jax import HybridLM
    from tests.conftest import decode_with_ops, random_ids

    model = HybridLM(tiny_cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(6))
    (ref, _), (got, _), traced = decode_with_ops(model, random_ids(44, (2, 10)), ["rms_norm"])
    assert "name=rms_norm" in traced
    assert rel_err(got, ref) < 2e-2  # bf16 model: a rounding flip in a norm moves later layers a little
    assert int(jnp.sum(jnp.argmax(got, -1) == jnp.argmax(ref, -1))) >= got.shape[0] * got.shape[1] - 1
