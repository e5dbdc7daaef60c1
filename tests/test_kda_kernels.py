"""Pallas KDA kernels (interpret mode on CPU) against the float32 jnp reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.linear_attention import kda, kda_decode_step, kda_decode_steps, kda_state_summary
from pallas_kernels.linear_attention import tuning as kda_tuning
from tests.conftest import examples, rel_err


def _decode_inputs(seed, b, n, dk, dv, scalar, dtype):
    ks = jax.random.split(jax.random.key(seed), 6)
    q, k = (jax.random.normal(x, (b, n, dk), dtype) for x in ks[:2])
    v = jax.random.normal(ks[2], (b, n, dv), dtype)
    g = -jax.nn.softplus(jax.random.normal(ks[3], (b, n) if scalar else (b, n, dk)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, n)))
    state = jax.random.normal(ks[5], (b, n, dk, dv))
    return q, k, v, g, beta, state


@settings(max_examples=examples(4), deadline=None)
@given(
    seed=st.integers(0, 2**16),
    b=st.integers(1, 3),
    n=st.integers(1, 3),
    dk=st.sampled_from([8, 16, 24]),
    dv=st.sampled_from([8, 20, 32]),
    scalar=st.booleans(),
    block_v=st.sampled_from([8, 16, 64]),
)
def test_decode_step_kernel_matches_reference(seed, b, n, dk, dv, scalar, block_v):
    args = _decode_inputs(seed, b, n, dk, dv, scalar, jnp.float32)
    ref_o, ref_s = kda_decode_step(*args, impl="reference")
    o, s = kda_decode_step(*args, impl="pallas", block_v=block_v, interpret=True)
    assert o.shape == ref_o.shape and s.shape == ref_s.shape
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(s)).all()  # every element written
    assert rel_err(o, ref_o) < 1e-5 and rel_err(s, ref_s) < 1e-5


def test_decode_step_kernel_bf16_inputs_and_state_in_place():
    args = _decode_inputs(7, 2, 2, 16, 16, False, jnp.bfloat16)
    ref_o, ref_s = kda_decode_step(*args, impl="reference")
    step = jax.jit(lambda *a: kda_decode_step(*a, impl="pallas", interpret=True), donate_argnums=5)
    o, s = step(*args[:5], args[5].copy())
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    assert rel_err(o, ref_o) < 1e-2 and rel_err(s, ref_s) < 1e-5  # bf16 output rounding only


@pytest.mark.parametrize("impl, scalar", [("reference", False), ("pallas", True)])
def test_decode_steps_keep_the_state_after_every_token(impl, scalar):
    """kda_decode_steps over T tokens: outputs equal the recurrence's, states[:, t] the recurrence's final state
    over the first t + 1 tokens; a token with beta = 0 and g = 0 (padding) leaves the state as it was."""
    b, t, n, dk, dv = 2, 5, 3, 16, 24
    ks = jax.random.split(jax.random.key(11), 6)
    q, k = (jax.random.normal(x, (b, t, n, dk)) for x in ks[:2])
    v = jax.random.normal(ks[2], (b, t, n, dv))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (b, t, n) if scalar else (b, t, n, dk)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, n)))
    beta, g = beta.at[1, 3].set(0.0), g.at[1, 3].set(0.0)  # row 1's 4th token is padding
    state = jax.random.normal(ks[5], (b, n, dk, dv))
    o, states = kda_decode_steps(q, k, v, g, beta, state, impl=impl, interpret=True if impl == "pallas" else None)
    assert o.shape == (b, t, n, dv) and states.shape == (b, t, n, dk, dv) and states.dtype == jnp.float32
    ref_o, _ = kda(q, k, v, g, beta, initial_state=state, impl="reference", form="recurrent")
    assert rel_err(o, ref_o) < 1e-5
    for i in range(t):
        _, s_i = kda(q[:, : i + 1], k[:, : i + 1], v[:, : i + 1], g[:, : i + 1], beta[:, : i + 1],
                     initial_state=state, impl="reference", form="recurrent")  # fmt: skip
        assert rel_err(states[:, i], s_i) < 1e-5, i
    np.testing.assert_array_equal(np.asarray(states[1, 3]), np.asarray(states[1, 2]))


def test_decode_step_bad_input_is_named():
    q, k, v, g, beta, state = _decode_inputs(0, 1, 2, 8, 8, False, jnp.float32)
    with pytest.raises(ValueError, match="impl='triton'"):
        kda_decode_step(q, k, v, g, beta, state, impl="triton")
    with pytest.raises(ValueError, match="block_v=48"):
        kda_decode_step(q, k, v, g, beta, state, impl="pallas", block_v=48)
    with pytest.raises(ValueError, match=r"state.shape=\(1, 2, 8, 4\)"):
        kda_decode_step(q, k, v, g, beta, state[..., :4])


def _prefill_inputs(seed, b, t, n, dk, dv, scalar, dtype, with_state):
    ks = jax.random.split(jax.random.key(seed), 6)
    q, k = (jax.random.normal(x, (b, t, n, dk), dtype) for x in ks[:2])
    v = jax.random.normal(ks[2], (b, t, n, dv), dtype)
    g = -jax.nn.softplus(jax.random.normal(ks[3], (b, t, n) if scalar else (b, t, n, dk))) * 1.5
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, n)))
    state = jax.random.normal(ks[5], (b, n, dk, dv)) if with_state else None
    return (q, k, v, g, beta), state


@settings(max_examples=examples(4), deadline=None)
@given(
    seed=st.integers(0, 2**16),
    b=st.integers(1, 2),
    t=st.sampled_from([1, 5, 23, 70, 130]),  # one token; one, two and three chunks of 64, none full
    n=st.integers(1, 2),
    dk=st.sampled_from([8, 16, 24]),
    dv=st.sampled_from([8, 20, 32]),
    scalar=st.booleans(),
    with_state=st.booleans(),
    solve=st.sampled_from(["neumann", "substitution"]),
)
def test_chunked_prefill_kernel_matches_reference(seed, b, t, n, dk, dv, scalar, with_state, solve):
    args, s0 = _prefill_inputs(seed, b, t, n, dk, dv, scalar, jnp.float32, with_state)
    ref_o, ref_s = kda(*args, initial_state=s0, impl="reference", form="recurrent")
    o, s = kda(*args, initial_state=s0, impl="pallas", precision="ieee", interpret=True, block_v=16, solve=solve)
    assert o.shape == ref_o.shape and s.shape == ref_s.shape
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(s)).all()  # every element written
    assert rel_err(o, ref_o) < 1e-5 and rel_err(s, ref_s) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("dk", [16, 128])  # 128: the diagonal sub-blocks in two K-slices
def test_chunked_prefill_kernel_strong_gates_and_bf16(dk):
    # log decays down to -40 per token: a factorised exp(G_i) exp(-G_j) would overflow within one chunk
    args, s0 = _prefill_inputs(3, 1, 100, 2, dk, 16, False, jnp.bfloat16, True)
    q, k, v, g, beta = args
    g = g * 25.0
    ref_o, ref_s = kda(q, k, v, g, beta, initial_state=s0, impl="reference", form="chunked", chunk_size=16)
    for solve in ("neumann", "substitution"):
        o, s = kda(q, k, v, g, beta, initial_state=s0, impl="pallas", precision="ieee", interpret=True, solve=solve)
        assert o.dtype == jnp.bfloat16
        assert rel_err(o, ref_o) < 1e-2 and rel_err(s, ref_s) < 1e-5


def _exact_a(q, k, g, beta, scale):
    """A_qk (a ≥ b) and β-scaled A_kk (a > b) per chunk of 64, float64, each decay as one exp of a difference."""
    q, k, g, beta = (np.asarray(x, np.float64) for x in (q, k, g, beta))
    b, t, n, dk = q.shape
    qn = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * scale
    kn = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    c = 64
    G = np.cumsum(g.reshape(b, t // c, c, n, dk), axis=2)  # [B, chunks, C, N, K]
    qn, kn = (x.reshape(b, t // c, c, n, dk) for x in (qn, kn))
    decay = np.exp(G[:, :, :, None] - G[:, :, None, :])  # [B, chunks, a, b, N, K]
    low = np.tril(np.ones((c, c)))[None, None, :, :, None]
    a_qk = np.einsum("xcanK,xcbnK,xcabnK->xcabn", qn, kn, np.where(low[..., None] > 0, decay, 0.0)) * low
    a_kk = np.einsum("xcanK,xcbnK,xcabnK->xcabn", kn, kn, np.where(low[..., None] > 0, decay, 0.0))
    a_kk *= np.tril(np.ones((c, c)), -1)[None, None, :, :, None] * beta.reshape(b, t // c, c, 1, n)
    # [B, chunks, a, b, N] -> the kernel's [B, T, N, C] layout
    return (x.transpose(0, 1, 2, 4, 3).reshape(b, t, n, c) for x in (a_qk, a_kk))


@pytest.mark.slow
@pytest.mark.parametrize("gate_scale", [0.05, 1.0, 25.0])
def test_a_kernel_levels_match_exact_decays(gate_scale):
    """`_a_kernel` (every decayed pair through one level of a binary split of the chunk, exp(G_a − G_b) as two
    factors ≤ 1) against each decay as one exponential, float64, from mild to strong gates (log decays down
    to about -40 per token: factors taken at the chunk start would overflow). Above the diagonal: zeros.
    The gated tiles and exp(G_C) against float64 running sums too."""
    from pallas_kernels.linear_attention.chunked import PARTS, _a_call, _chunk_cumsum

    (q, k, _, g, beta), _ = _prefill_inputs(13, 2, 128, 2, 32, 16, False, jnp.float32, False)
    g = g * gate_scale
    G = _chunk_cumsum(g, interpret=True, params={})
    aqk, akk, qg, kg, kb, gl = _a_call(
        q,
        k,
        G,
        beta,
        scale=0.3,
        l2norm=True,
        precision="ieee",
        interpret=True,
        num_warps=8,
        parts=PARTS,
    )
    ref_qk, ref_kk = _exact_a(q, k, g, beta, 0.3)
    assert np.isfinite(np.asarray(aqk)).all() and np.isfinite(np.asarray(akk)).all()
    np.testing.assert_allclose(np.asarray(aqk), ref_qk, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(akk), ref_kk, rtol=1e-4, atol=1e-6)
    # the gated tiles and exp(G_C) against float64 running sums of each chunk's decays
    g64 = np.asarray(g, np.float64).reshape(2, 2, 64, 2, 32)
    run, total = np.cumsum(g64, 2), g64.sum(2, keepdims=True)
    np.testing.assert_allclose(np.asarray(gl)[..., 0], np.exp(total[:, :, 0]), rtol=1e-5, atol=1e-30)
    qn, kn = (np.asarray(x, np.float64) for x in (q, k))
    qn = qn / np.sqrt((qn * qn).sum(-1, keepdims=True) + 1e-6) * 0.3
    kn = kn / np.sqrt((kn * kn).sum(-1, keepdims=True) + 1e-6)
    b64 = np.asarray(beta, np.float64)[..., None]
    for got, want in [(qg, np.exp(run).reshape(q.shape) * qn), (kg, np.exp(total - run).reshape(q.shape) * kn),
                      (kb, b64 * np.exp(run).reshape(q.shape) * kn)]:  # fmt: skip
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_chunked_prefill_kernel_bf16_products():
    # fla-like precision: bfloat16 operands, float32 accumulation (and a float32 (I + A)^-1 chain)
    (q, k, v, g, beta), s0 = _prefill_inputs(5, 1, 90, 2, 32, 32, False, jnp.bfloat16, True)
    ref_o, ref_s = kda(q, k, v, g, beta, initial_state=s0, impl="reference", form="recurrent")
    o, s = kda(q, k, v, g, beta, initial_state=s0, impl="pallas", precision="bf16", interpret=True)
    assert rel_err(o, ref_o) < 2e-2 and rel_err(s, ref_s) < 2e-2
    with pytest.raises(ValueError, match="precision='fp8'"):
        kda(q, k, v, g, beta, impl="pallas", precision="fp8")
    with pytest.raises(ValueError, match="solve='lu'"):
        kda(q, k, v, g, beta, impl="pallas", solve="lu")


@settings(max_examples=examples(4), deadline=None)
@given(
    seed=st.integers(0, 2**16),
    t=st.sampled_from([7, 64, 100]),
    dk=st.sampled_from([16, 24]),
    dv=st.sampled_from([16, 32]),
    scalar=st.booleans(),
)
def test_state_summary_kernel_matches_reference(seed, t, dk, dv, scalar):
    (q, k, v, g, beta), s0 = _prefill_inputs(seed, 2, t, 2, dk, dv, scalar, jnp.float32, True)
    g = g * 0.02  # mild decay: over 100 tokens the transition M must stay far from zero to be compared
    ref_m, ref_e = kda_state_summary(k, v, g, beta, impl="reference", chunk_size=16)
    m, e = kda_state_summary(k, v, g, beta, impl="pallas", precision="ieee", interpret=True)
    assert rel_err(m, ref_m) < 1e-5 and rel_err(e, ref_e) < 1e-5
    # the summary reproduces the shard's final state from any start state
    _, s_end = kda(q, k, v, g, beta, initial_state=s0, impl="reference", form="recurrent")
    s_from_summary = jnp.einsum("bnkj,bnjv->bnkv", m, s0, precision="highest") + e
    assert rel_err(s_from_summary, s_end) < 1e-5


def test_state_summary_kernel_takes_the_prefills_block_forms(monkeypatch):
    """The summary's phase 1 is the prefill's, with `tuning.A_BLOCKS` read when it is traced: the block forms'
    span test (a max over the chunk) is in the kernel with the default and not with () (the binary split), and
    both match the reference."""
    (_, k, v, g, beta), _ = _prefill_inputs(7, 1, 100, 2, 16, 16, False, jnp.float32, False)
    g = g * 0.02
    ref_m, ref_e = kda_state_summary(k, v, g, beta, impl="reference", chunk_size=16)
    for blocks in ((64, 16), ()):
        monkeypatch.setattr(kda_tuning, "A_BLOCKS", blocks)
        run = lambda *a: kda_state_summary(*a, impl="pallas", precision="ieee", interpret=True)  # noqa: E731
        m, e = run(k, v, g, beta)
        assert rel_err(m, ref_m) < 1e-5 and rel_err(e, ref_e) < 1e-5, blocks
        assert ("reduce_max" in str(jax.make_jaxpr(run)(k, v, g, beta))) == bool(blocks), blocks


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_variable_length_batch_equals_separate_sequences(impl):
    lengths = [5, 0, 70, 33, 64]  # an empty sequence too, one of whole chunks
    cu = np.concatenate([[0], np.cumsum(lengths)])
    (q, k, v, g, beta), _ = _prefill_inputs(11, 1, int(cu[-1]), 2, 16, 16, False, jnp.float32, False)
    s0 = jax.random.normal(jax.random.key(5), (len(lengths), 2, 16, 16))
    kw = dict(impl=impl, precision="ieee", interpret=True) if impl == "pallas" else dict(impl=impl, chunk_size=16)
    kw = kw if impl == "pallas" else {**kw, "form": "chunked"}
    o, s = kda(q, k, v, g, beta, initial_state=s0, cu_seqlens=cu, **kw)
    assert o.shape == v.shape and s.shape == s0.shape
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        if a == b:
            assert rel_err(s[i], s0[i]) == 0  # nothing to run: the state is unchanged
            continue
        ref_o, ref_s = kda(
            *(x[:, a:b] for x in (q, k, v, g, beta)), initial_state=s0[i : i + 1], impl="reference", form="recurrent"
        )
        assert rel_err(o[:, a:b], ref_o) < 1e-5 and rel_err(s[i : i + 1], ref_s) < 1e-5
    if impl == "pallas":  # chunk-aligned packing: 1 + 0 + 2 + 1 + 1 chunks, not 5 rows of the longest (70)
        jaxpr = str(jax.make_jaxpr(lambda *a: kda(*a, initial_state=s0, cu_seqlens=cu, **kw))(q, k, v, g, beta))
        assert "f32[1,320,2,16]" in jaxpr and "f32[5,70," not in jaxpr
    with pytest.raises(ValueError, match=r"cu_seqlens=\[0, 3\]"):
        kda(q, k, v, g, beta, cu_seqlens=[0, 3])


def test_packed_sequences_with_padded_channels_and_per_head_decay():
    """The packed path where the inputs are not what the kernels take as they are: K = 24 and V = 20 (padded to
    32 channels: the channel pad is the one copy left) and a per-head g [1, T, N] (broadcast over K): each
    sequence's outputs and final state equal the recurrence over it alone."""
    lengths = [5, 70, 33]
    cu = np.concatenate([[0], np.cumsum(lengths)])
    (q, k, v, g, beta), _ = _prefill_inputs(21, 1, int(cu[-1]), 2, 24, 20, True, jnp.float32, False)
    s0 = jax.random.normal(jax.random.key(6), (3, 2, 24, 20))
    o, s = kda(q, k, v, g, beta, initial_state=s0, cu_seqlens=cu, impl="pallas", precision="ieee", interpret=True)
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        ref_o, ref_s = kda(
            *(x[:, a:b] for x in (q, k, v, g, beta)), initial_state=s0[i : i + 1], impl="reference", form="recurrent"
        )
        assert rel_err(o[:, a:b], ref_o) < 1e-5 and rel_err(s[i : i + 1], ref_s) < 1e-5, i


def test_packed_inputs_read_in_place_equal_the_laid_out_copy():
    """`kda_chunked_pallas(rows=)`: phase 1 reads each chunk's rows from the packed inputs by the row table and
    zeros the rows past its valid ones. Bit for bit what the same kernels give on the inputs copied into the
    chunk layout, with the input rows no chunk owns set to NaN (a pad row that read one would make the state
    NaN) and the last chunk's pad rows pointing past the input's end."""
    from pallas_kernels.linear_attention.chunked import kda_chunked_pallas

    (q, k, v, g, beta), _ = _prefill_inputs(3, 1, 150, 2, 16, 32, False, jnp.float32, False)
    first, valid = np.array([0, 50, 114]), np.array([30, 64, 36])
    q, k, v, g, beta = (x.at[:, 30:50].set(jnp.nan) for x in (q, k, v, g, beta))
    src = np.where(np.arange(64) < valid[:, None], first[:, None] + np.arange(64), -1).reshape(-1)

    def laid_out(x):
        keep = (src >= 0).reshape((1, -1) + (1,) * (x.ndim - 2))
        return jnp.where(keep, x[:, np.maximum(src, 0)], 0.0)

    s0 = jax.random.normal(jax.random.key(1), (1, 2, 16, 32))
    kw = dict(scale=0.25, l2norm=True, block_v=16, precision="ieee", interpret=True, a_blocks=(64, 16))
    rows = (jnp.asarray(first, jnp.int32), jnp.asarray(valid, jnp.int32))
    o, s = kda_chunked_pallas(q, k, v, g, beta, s0, rows=rows, **kw)
    o_copy, s_copy = kda_chunked_pallas(*(laid_out(x) for x in (q, k, v, g, beta)), s0, **kw)
    assert o.shape == (1, 192, 2, 32) and bool(jnp.isfinite(s).all())
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_copy))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s_copy))
    with pytest.raises(ValueError, match="must be two int32"):
        kda_chunked_pallas(q, k, v, g, beta, s0, rows=(rows[0], rows[1].astype(jnp.int16)), **kw)


def test_auto_runs_the_prefill_kernel_on_gpu(monkeypatch):
    """On a GPU, "auto" prefills through the Pallas kernels (bf16 products for bf16 inputs) and decodes a single
    token through the recurrence; on CPU the jnp chunked form."""
    (q, k, v, g, beta), _ = _prefill_inputs(0, 1, 70, 1, 16, 16, False, jnp.bfloat16, False)

    def traced(t):
        fn = lambda *a: kda(*a, impl="auto", interpret=True)  # noqa: E731
        return str(jax.make_jaxpr(fn)(q[:, :t], k[:, :t], v[:, :t], g[:, :t], beta[:, :t]))

    from pallas_kernels.linear_attention import api

    seen = []
    kernel = api.kda_chunked_pallas
    monkeypatch.setattr(api, "kda_chunked_pallas", lambda *a, **kw: seen.append(kw["precision"]) or kernel(*a, **kw))
    assert "pallas_call" not in traced(70)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    jaxpr = traced(70)
    assert all(f"name=kda_chunk_{k}" in jaxpr for k in ("a", "solve", "state"))  # phase 1 split by default
    assert seen == ["bf16"]
    assert "pallas_call" not in traced(1)


@pytest.mark.parametrize("t, every", [(200, 64), (256, 128), (200, 40)])  # in the state pass (x2), by segments
def test_prefill_kernel_states_at_boundaries(t, every):
    """kda(impl="pallas", state_every=E): the state pass writes the states at every E tokens (E a multiple of 64;
    otherwise segment calls): each equals the reference's final state after (j + 1)·E tokens, and the outputs
    and final state are those of the call without snapshots (bit for bit from the state pass; segment calls
    chunk the sequence differently)."""
    args, s0 = _prefill_inputs(5, 2, t, 2, 24, 20, False, jnp.float32, True)
    kw = dict(initial_state=s0, impl="pallas", precision="ieee", interpret=True, block_v=16)
    o, s, states = kda(*args, **kw, state_every=every)
    plain_o, plain_s = kda(*args, **kw)
    if every % 64 == 0:
        np.testing.assert_array_equal(np.asarray(o), np.asarray(plain_o))
        np.testing.assert_array_equal(np.asarray(s), np.asarray(plain_s))
    assert rel_err(o, plain_o) < 1e-5 and rel_err(s, plain_s) < 1e-5
    assert states.shape == (2, t // every, 2, 24, 20)
    for j in range(t // every):
        n = (j + 1) * every
        _, want = kda(*(x[:, :n] for x in args), initial_state=s0, impl="reference", form="recurrent")
        assert rel_err(states[:, j], want) < 1e-5, j


def _graded_gates(seed, t=256, n=2, dk=32):
    """KDA inputs whose four 64-token chunks need, in order, the 64-, 16- and 32-row block forms of the A kernel
    and then the binary split (`chunked._a_pairs`): log decays of −0.05, −3, −2 and −12 per token on one channel
    (spans in log2 over 63 / 31 / 15 steps against the A_SPAN_LIMIT of 100 to 116), milder on the others."""
    (q, k, v, _, beta), _ = _prefill_inputs(seed, 1, t, n, dk, dk, False, jnp.float32, False)
    per_chunk = jnp.repeat(jnp.asarray([-0.05, -3.0, -2.0, -12.0]), 64)[:t]
    mild = -0.02 * jax.nn.softplus(jax.random.normal(jax.random.key(seed + 1), (1, t, n, dk)))
    g = mild.at[:, :, :, 3].set(per_chunk[None, :, None])
    return q, k, v, g, beta


def test_a_kernel_block_forms_follow_each_chunks_span():
    """Each chunk takes the coarsest block form its span allows, tried largest first: chunk by chunk, A_qk with
    a_blocks=(64, 32, 16) is bit for bit that of the one size the chunk needs (64, 16, 32) and, for the strong
    chunk, the binary split's; the mild chunks' differ from the split's by rounding only."""
    from pallas_kernels.linear_attention.chunked import _intra

    q, k, v, g, beta = _graded_gates(3)
    kw = dict(scale=32**-0.5, l2norm=True, precision="ieee", interpret=True)
    run = lambda blocks: _intra(q, k, v, g, beta, a_blocks=blocks, **kw)  # noqa: E731
    aqk = lambda out: np.asarray(out[0], np.float64).reshape(4, 64, 2, 64)  # noqa: E731 — per chunk
    levels, blocks = run(()), run((64, 32, 16))
    single = {size: aqk(run((size,))) for size in (64, 32, 16)}
    aqk_l, aqk_b = aqk(levels), aqk(blocks)
    for c, size in enumerate((64, 16, 32)):
        np.testing.assert_array_equal(aqk_b[c], single[size][c])
        assert not np.array_equal(aqk_b[c], aqk_l[c]), c  # another form than the split's
        assert np.abs(aqk_b[c] - aqk_l[c]).max() < 1e-5 * np.abs(aqk_l[c]).max(), c
    np.testing.assert_array_equal(aqk_b[3], aqk_l[3])
    for x, y in zip(levels[1:], blocks[1:], strict=True):  # W, U, q_g, k_g, exp(G_C)
        assert rel_err(y, x) < 1e-5


@pytest.mark.parametrize("precision,takes_blocks", [("ieee", False), ("tf32", True), ("bf16", True)])
def test_a_kernel_block_span_limit_follows_the_products_precision(precision, takes_blocks):
    """16-row blocks whose decay (span 108 in log2) falls in the first half of each block: the factors of the
    first rows reach 2^-108, where an element below 2^-18 is subnormal and may be flushed. float32 products
    ("ieee", limit 100) take the binary split bit for bit; bf16 and TF32 (limits 116 and 114: what a flushed
    element could add is under their rounding) take the block form."""
    from pallas_kernels.linear_attention.chunked import _intra

    (q, k, v, _, beta), _ = _prefill_inputs(5, 1, 64, 2, 32, 32, False, jnp.float32, False)
    row = np.arange(64) % 16
    log2_decay = np.where((row >= 1) & (row <= 8), -108 / 8, -0.01)  # 8 rows of the 15 steps carry the span
    g = jnp.broadcast_to(jnp.asarray(log2_decay * np.log(2), jnp.float32)[None, :, None, None], q.shape)
    kw = dict(scale=32**-0.5, l2norm=True, precision=precision, interpret=True)
    split, blocks = (np.asarray(_intra(q, k, v, g, beta, a_blocks=b, **kw)[0]) for b in ((), (16,)))
    assert np.array_equal(blocks, split) is not takes_blocks
    assert np.abs(blocks - split).max() < 2e-2 * np.abs(split).max()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_kernel_block_forms_match_the_reference(dtype, monkeypatch):
    """The whole prefill with a_blocks against the float32 recurrence (bf16: bf16 products, same bound as the
    binary split's tests), taken on every path of kda and by default (tuning.A_BLOCKS); a_blocks out of order or of
    another size is a ValueError naming it."""
    args = tuple(x.astype(dtype) if x.ndim == 4 and i != 3 else x for i, x in enumerate(_graded_gates(4)))
    ref_o, ref_s = kda(*args, impl="reference", form="recurrent")
    o, s = kda(*args, impl="pallas", interpret=True, block_v=16, a_blocks=(64, 16))
    bound = 1e-4 if dtype == jnp.float32 else 2e-2
    assert rel_err(o, ref_o) < bound and rel_err(s, ref_s) < bound
    # every path of kda passes a_blocks to the A kernel: its span branches are in the traced program
    cu = np.asarray([0, 100, 256])
    paths = [{}, {"state_every": 128}, {"cu_seqlens": cu}]
    paths += [{"impl": "mosaic"}, {"impl": "mosaic", "cu_seqlens": cu}] if dtype == jnp.bfloat16 else []
    jaxpr = lambda call, **kw: str(jax.make_jaxpr(lambda *a: kda(*a, **call, **kw))(*args))  # noqa: E731
    for extra in paths:  # (the Mosaic state pass has branches of its own: counted on both sides)
        call = {"impl": "pallas", "interpret": True, **extra}
        with_blocks, without = jaxpr(call, a_blocks=(64, 16)), jaxpr(call, a_blocks=())
        assert with_blocks.count("cond[") - without.count("cond[") == 2, extra
        assert jaxpr(call) == jaxpr(call, a_blocks=kda_tuning.A_BLOCKS), extra  # the default
    call = {"impl": "pallas", "interpret": True}
    with monkeypatch.context() as m:  # the default is read from tuning.py at the call
        m.setattr(kda_tuning, "A_BLOCKS", ())
        assert jaxpr(call) == jaxpr(call, a_blocks=())
    for bad in ((16, 64), (48,), [64]):
        with pytest.raises(ValueError, match=r"a_blocks=.* must be a tuple of sizes from \(64, 32, 16\)"):
            kda(*args, impl="pallas", interpret=True, a_blocks=bad)
