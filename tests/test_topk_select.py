"""Radix-select Top-K equals lax.top_k: values, indices and the tie order."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.indexer.select_reference import sortable_bits, top_k_radix
from tests.conftest import examples


@settings(max_examples=examples(8), deadline=None)
@given(
    seed=st.integers(0, 2**16),
    rows=st.integers(1, 5),
    s=st.integers(1, 300),
    kfrac=st.floats(0.01, 1.0),
    levels=st.sampled_from([0, 3, 50]),  # 0: continuous; else few distinct values (many ties)
    neg_inf=st.floats(0.0, 0.9),
    digit_bits=st.sampled_from([1, 2, 4, 8]),
)
def test_radix_select_equals_lax_top_k(seed, rows, s, kfrac, levels, neg_inf, digit_bits):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, s)).astype(np.float32) * 10
    if levels:
        x = np.round(x / 10 * levels) / levels
    x[rng.random((rows, s)) < neg_inf] = -np.inf  # masked (causal) positions, also ties among themselves
    x[rng.random((rows, s)) < 0.05] = 0.0
    x[rng.random((rows, s)) < 0.05] = -0.0  # -0.0 < +0.0 in the bit order; lax.top_k orders them the same way
    k = max(1, int(kfrac * s))
    ref_v, ref_i = jax.lax.top_k(jnp.asarray(x), k)
    v, i = top_k_radix(jnp.asarray(x), k, digit_bits=digit_bits)
    np.testing.assert_array_equal(np.asarray(i), np.asarray(ref_i))
    np.testing.assert_array_equal(np.asarray(v), np.asarray(ref_v))


def test_radix_select_leading_axes_and_jit():
    x = jax.random.normal(jax.random.key(0), (2, 3, 70))
    ref = jax.lax.top_k(x, 9)
    got = jax.jit(lambda x: top_k_radix(x, 9))(x)
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sortable_bits_order_and_errors():
    vals = jnp.asarray([-jnp.inf, -3.5, -1e-30, 0.0, 1e-30, 2.0, jnp.inf], jnp.float32)
    bits = np.asarray(sortable_bits(vals)).astype(np.int64)
    assert (np.diff(bits) > 0).all()
    with pytest.raises(ValueError, match="k=5"):
        top_k_radix(jnp.zeros((2, 4)), 5)
    with pytest.raises(ValueError, match="digit_bits=3"):
        top_k_radix(jnp.zeros((2, 4)), 2, digit_bits=3)
