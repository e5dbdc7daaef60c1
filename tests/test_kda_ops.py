"""Chunked KDA (WY / UT transform) against the token recurrence, and the recurrence against numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.linear_attention import kda
from tests.conftest import examples, rel_err


def _inputs(seed, b, t, n, dk, dv, scalar=False, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(ks[0], (b, t, n, dk), dtype)
    k = jax.random.normal(ks[1], (b, t, n, dk), dtype)
    v = jax.random.normal(ks[2], (b, t, n, dv), dtype)
    gshape = (b, t, n) if scalar else (b, t, n, dk)
    # Strong decay on some channels (down to exp(-8) per token) to exercise the masked exp(G_i - G_j).
    g = -jax.nn.softplus(jax.random.normal(ks[3], gshape) * 2.0) * 2.0
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, n)))
    s0 = jax.random.normal(ks[5], (b, n, dk, dv))
    return q, k, v, g, beta, s0


def _numpy_recurrence(q, k, v, g, beta, s0):
    q, k, v, g, beta, s = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, s0))
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    if g.ndim == 3:
        g = np.broadcast_to(g[..., None], k.shape)
    o = np.zeros(v.shape)
    for t in range(q.shape[1]):
        s = s * np.exp(g[:, t])[..., None]
        ks = np.einsum("bnk,bnkv->bnv", k[:, t], s)
        s = s + beta[:, t][..., None, None] * k[:, t][..., None] * (v[:, t] - ks)[..., None, :]
        o[:, t] = np.einsum("bnk,bnkv->bnv", q[:, t], s)
    return o, s


@pytest.mark.slow
@pytest.mark.parametrize("scalar", [False, True])
def test_recurrent_matches_numpy(scalar):
    q, k, v, g, beta, s0 = _inputs(1, 2, 13, 3, 8, 5, scalar)
    o, s = kda(q, k, v, g, beta, initial_state=s0, impl="reference", form="recurrent")
    o_ref, s_ref = _numpy_recurrence(q, k, v, g, beta, s0)
    assert rel_err(o, o_ref) < 1e-5
    assert rel_err(s, s_ref) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize(
    "t,chunk,scalar", [(37, 8, False), (64, 16, False), (50, 16, True), (1, 8, False), (5, 8, True)]
)
def test_chunked_matches_recurrent(t, chunk, scalar):
    q, k, v, g, beta, s0 = _inputs(t, 2, t, 3, 16, 8, scalar)
    o_r, s_r = kda(q, k, v, g, beta, initial_state=s0, impl="reference", form="recurrent")
    o_c, s_c = kda(q, k, v, g, beta, initial_state=s0, impl="reference", form="chunked", chunk_size=chunk)
    assert rel_err(o_c, o_r) < 1e-5
    assert rel_err(s_c, s_r) < 1e-5


@settings(max_examples=examples(5), deadline=None)
@given(
    b=st.integers(1, 2),
    t=st.integers(1, 40),
    n=st.integers(1, 3),
    dk=st.sampled_from([4, 8, 16]),
    dv=st.sampled_from([3, 8]),
    chunk=st.sampled_from([4, 8, 16]),
    scalar=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_chunked_matches_recurrent_random_shapes(b, t, n, dk, dv, chunk, scalar, seed):
    q, k, v, g, beta, s0 = _inputs(seed, b, t, n, dk, dv, scalar)
    o_r, s_r = kda(q, k, v, g, beta, initial_state=s0, impl="reference", form="recurrent")
    o_c, s_c = kda(q, k, v, g, beta, initial_state=s0, impl="reference", form="chunked", chunk_size=chunk)
    assert rel_err(o_c, o_r) < 1e-5
    assert rel_err(s_c, s_r) < 1e-5


@pytest.mark.slow
def test_zero_initial_state_equals_none_and_split_sequences_compose():
    q, k, v, g, beta, _ = _inputs(3, 1, 30, 2, 8, 8)
    o_full, s_full = kda(q, k, v, g, beta, impl="reference", form="chunked", chunk_size=8)
    o1, s1 = kda(
        q[:, :11], k[:, :11], v[:, :11], g[:, :11], beta[:, :11], impl="reference", form="chunked", chunk_size=8
    )
    o2, s2 = kda(
        q[:, 11:],
        k[:, 11:],
        v[:, 11:],
        g[:, 11:],
        beta[:, 11:],
        initial_state=s1,
        impl="reference",
        form="chunked",
        chunk_size=8,
    )
    assert rel_err(jnp.concatenate([o1, o2], 1), o_full) < 1e-5
    assert rel_err(s2, s_full) < 1e-5


def test_bf16_inputs_keep_float32_state():
    q, k, v, g, beta, s0 = _inputs(4, 1, 20, 2, 8, 8, dtype=jnp.bfloat16)
    o, s = kda(q, k, v, g, beta, initial_state=s0, impl="reference", form="chunked", chunk_size=8)
    o_ref, s_ref = _numpy_recurrence(q, k, v, g, beta, s0)
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    assert rel_err(o, o_ref) < 1e-2
    assert rel_err(s, s_ref) < 1e-5


def test_bad_arguments_are_named():
    q, k, v, g, beta, s0 = _inputs(0, 1, 4, 1, 4, 4)
    with pytest.raises(ValueError, match="impl='pallas_v9'"):
        kda(q, k, v, g, beta, impl="pallas_v9")
    with pytest.raises(ValueError, match="g.shape"):
        kda(q, k, v, g[..., :2], beta)


@pytest.mark.slow
@pytest.mark.parametrize("scalar", [False, True])
def test_state_summary_is_the_affine_map_of_the_shard(scalar):
    from pallas_kernels.linear_attention import apply_summary, compose_summaries, kda_state_summary

    q, k, v, g, beta, s0 = _inputs(11, 2, 45, 2, 8, 6, scalar)
    m, e = kda_state_summary(k, v, g, beta, chunk_size=8)
    _, s_end = kda(q, k, v, g, beta, initial_state=s0, impl="reference", form="recurrent")
    assert rel_err(apply_summary((m, e), s0), s_end) < 1e-5
    _, s_zero = kda(q, k, v, g, beta, impl="reference", form="recurrent")
    assert rel_err(e, s_zero) < 1e-5  # E is the final state from zero
    # Two shards composed equal the whole (the fold each CP rank does over the ranks before it).
    first = kda_state_summary(k[:, :20], v[:, :20], g[:, :20], beta[:, :20], chunk_size=8)
    second = kda_state_summary(k[:, 20:], v[:, 20:], g[:, 20:], beta[:, 20:], chunk_size=8)
    both = compose_summaries(first, second)
    assert rel_err(both[0], m) < 1e-5 and rel_err(both[1], e) < 1e-5


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
@pytest.mark.parametrize("t, every", [(150, 64), (150, 40), (30, 40)])  # aligned to chunks, not, none inside
def test_states_after_every_segment_equal_prefix_runs(form, t, every):
    """kda(state_every=E): the outputs and final state of the plain call, and state j equal to the final state of
    a run over the first (j + 1)·E tokens (numpy, float64); T < E gives no states."""
    q, k, v, g, beta, s0 = _inputs(11, 2, t, 2, 16, 8)
    o, s, states = kda(q, k, v, g, beta, initial_state=s0, impl="reference", form=form, chunk_size=16,
                       state_every=every)  # fmt: skip
    want_o, want_s = kda(q, k, v, g, beta, initial_state=s0, impl="reference", form=form, chunk_size=16)
    assert states.shape == (2, t // every, 2, 16, 8) and states.dtype == jnp.float32
    assert rel_err(o, want_o) < 1e-6 and rel_err(s, want_s) < 1e-6
    for j in range(t // every):
        n = (j + 1) * every
        _, want = _numpy_recurrence(q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], s0)
        assert rel_err(states[:, j], want) < 1e-5, j


def test_state_every_bad_arguments_are_named():
    q, k, v, g, beta, _ = _inputs(0, 1, 8, 1, 16, 8)
    for bad in (0, -64, 2.5, True):
        with pytest.raises(ValueError, match=f"state_every={bad!r}"):
            kda(q, k, v, g, beta, impl="reference", state_every=bad)
    with pytest.raises(ValueError, match="state_every is not taken with cu_seqlens"):
        kda(q, k, v, g, beta, impl="reference", cu_seqlens=[0, 3, 8], state_every=4)
