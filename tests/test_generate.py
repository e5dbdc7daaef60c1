"""generate(): greedy equals argmax of the full forward, batching, EOS, sampling, determinism, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax import generate, sample_logits
from tests.conftest import random_ids

GEN = jax.jit(generate, static_argnames=("max_new_tokens", "top_k"))


@pytest.mark.slow
def test_greedy_equals_repeated_argmax_of_full_forward(tiny_model, jitted):
    lens = [9, 4]
    ids = random_ids(20, (2, 9))
    out = GEN(tiny_model, ids, prompt_lengths=jnp.array(lens), max_new_tokens=6)
    np.testing.assert_array_equal(out.lengths, [6, 6])
    for i, n in enumerate(lens):
        seq = jnp.concatenate([ids[i, :n], out.tokens[i]])[None]
        logits = jitted["forward"](tiny_model, seq)[0]
        # Teacher forcing: each generated token is the argmax after the tokens before it.
        np.testing.assert_array_equal(jnp.argmax(logits[n - 1 : n + 5], axis=-1), out.tokens[i])


@pytest.mark.slow
def test_eos_stops_each_sequence(tiny_model):
    ids = random_ids(21, (2, 5))
    free = GEN(tiny_model, ids, max_new_tokens=6)
    eos = int(free.tokens[0, 2])  # make row 0's third token the EOS
    out = GEN(tiny_model, ids, max_new_tokens=6, eos_id=eos, pad_id=0)
    n0 = int(np.argmax(np.asarray(free.tokens[0]) == eos)) + 1
    assert int(out.lengths[0]) == n0 <= 3
    np.testing.assert_array_equal(out.tokens[0, :n0], free.tokens[0, :n0])
    assert (np.asarray(out.tokens[0, n0:]) == 0).all()
    hits = np.nonzero(np.asarray(free.tokens[1]) == eos)[0]
    assert int(out.lengths[1]) == (hits[0] + 1 if hits.size else 6)


@pytest.mark.slow
def test_jitted_sampling_is_deterministic_for_a_key(tiny_model):
    ids = random_ids(22, (2, 4))
    kw = dict(max_new_tokens=8, temperature=0.9, top_k=50, top_p=0.95)
    a = GEN(tiny_model, ids, rng=jax.random.key(3), **kw)
    b = GEN(tiny_model, ids, rng=jax.random.key(3), **kw)
    c = GEN(tiny_model, ids, rng=jax.random.key(4), **kw)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens)


def test_sample_logits_respects_top_k_top_p_and_temperature():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 2000))
    keys = jax.random.key(0)
    greedy = sample_logits(logits, keys, temperature=0.0)
    assert (np.asarray(greedy) == 0).all()
    top2 = np.asarray(sample_logits(logits, keys, temperature=1.0, top_k=2))
    assert set(top2.tolist()) == {0, 1}
    nucleus = np.asarray(sample_logits(logits, keys, temperature=1.0, top_p=0.7))  # keeps {0, 1}
    assert set(nucleus.tolist()) == {0, 1}
    free = np.asarray(sample_logits(logits, keys, temperature=1.0))
    assert set(free.tolist()) == {0, 1, 2, 3}
    assert abs((free == 0).mean() - 0.5) < 0.05


@pytest.mark.slow
def test_bad_input_raises_naming_the_value(tiny_model):
    ok = jnp.array([[1, 2, 3]])
    with pytest.raises(ValueError, match="token id 999 is outside the vocabulary"):
        generate(tiny_model, jnp.array([[1, 999]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="empty prompt"):
        generate(tiny_model, jnp.zeros((1, 0), jnp.int32), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompt_lengths \[0\]"):
        generate(tiny_model, ok, prompt_lengths=jnp.array([0]), max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt length 3 \\+ max_new_tokens 1022 = 1025 exceeds"):
        generate(tiny_model, ok, max_new_tokens=1022)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        generate(tiny_model, ok, max_new_tokens=0)
    with pytest.raises(ValueError, match="rng=jax.random.key"):
        generate(tiny_model, ok, max_new_tokens=2, temperature=0.7)
    with pytest.raises(ValueError, match="top_p=1.5"):
        generate(tiny_model, ok, max_new_tokens=2, top_p=1.5, temperature=1.0, rng=jax.random.key(0))
    # Token ids in the padding are never read, so they are not errors.
    generate(tiny_model, jnp.array([[1, 2, -1]]), prompt_lengths=jnp.array([2]), max_new_tokens=1)


@pytest.mark.slow
def test_under_jit_bad_rows_come_back_flagged_and_the_others_unchanged(tiny_model):
    """Values jit cannot check raise nothing there: the row is flagged, gets pad tokens and length 0, and the
    other rows generate exactly what they would alone."""
    ids = random_ids(23, (3, 5))
    good = GEN(tiny_model, ids, max_new_tokens=4)
    assert not np.asarray(good.error).any()
    bad_ids = ids.at[1, 2].set(100_000)  # outside the vocabulary, under jit
    lens = jnp.array([5, 5, 0])  # row 2: an empty prompt
    out = GEN(tiny_model, bad_ids, prompt_lengths=lens, max_new_tokens=4, pad_id=7)
    np.testing.assert_array_equal(out.error, [False, True, True])
    np.testing.assert_array_equal(out.lengths, [4, 0, 0])
    assert (np.asarray(out.tokens[1:]) == 7).all()
    np.testing.assert_array_equal(out.tokens[0], good.tokens[0])
    # traced sampling parameters out of range flag every row
    sample = jax.jit(generate, static_argnames=("max_new_tokens",))
    for t, p in ((-0.5, 0.9), (1.0, 1.5), (1.0, 0.0)):
        flagged = sample(tiny_model, ids, max_new_tokens=2, temperature=t, top_p=p, rng=jax.random.key(0))
        assert np.asarray(flagged.error).all() and not np.asarray(flagged.lengths).any(), (t, p)


@pytest.mark.slow
def test_on_token_streams_every_token_in_order(tiny_model):
    seen = []
    ids = random_ids(24, (2, 4))
    stream = jax.jit(generate, static_argnames=("max_new_tokens", "eos_id", "on_token"))
    free = GEN(tiny_model, ids, max_new_tokens=5)
    eos = int(free.tokens[0, 1])
    out = stream(tiny_model, ids, max_new_tokens=5, eos_id=eos, on_token=lambda s, t: seen.append((int(s), t)))
    jax.effects_barrier()
    assert [s for s, _ in seen] == list(range(len(seen))) and 2 <= len(seen) <= 5
    np.testing.assert_array_equal(np.stack([t for _, t in seen], axis=1), out.tokens[:, : len(seen)])


@pytest.mark.slow
def test_chunked_prefill_equals_one_shot(tiny_model):
    """generate(prefill_chunk=C) prefills through the caches C tokens at a time (rows of mixed lengths running out
    at different chunks; short remainders in smaller calls) and decodes exactly what the one-shot prefill does."""
    from hybrid_jax.generate import prefill_chunked

    ids = random_ids(25, (3, 19))
    lens = jnp.array([19, 11, 4])
    one = GEN(tiny_model, ids, prompt_lengths=lens, max_new_tokens=5)
    chunked = jax.jit(generate, static_argnames=("max_new_tokens", "prefill_chunk"))
    # 19 = 2 x 7 + 5: 7 divides no row (the rows run out in chunks 1, 2 and 3); CI time: one chunk size here (a
    # generate compile each), the chunk / tail splits of 6 below
    out = chunked(tiny_model, ids, prompt_lengths=lens, max_new_tokens=5, prefill_chunk=7)
    np.testing.assert_array_equal(out.tokens, one.tokens)
    np.testing.assert_array_equal(out.lengths, one.lengths)
    # chunks of 6, the rows' lengths traced (one compile per tail size):
    # [19, 11, 4], tail None: 4 calls of 6, the last row-0 call holding 1 token;
    # [19, 11, 4], tail 4: rows 1 and 2 finish inside chunk calls that run anyway, row 0's last token in a call of 4;
    # [17, 5, 2], tail 4: row 0's remainder (5 > 6 - 4) takes one more chunk call, no call of 4
    run = jax.jit(lambda m, i, c, n, tail: prefill_chunked(m, i, c, n, chunk=6, tail_chunk=tail), static_argnums=4)
    one_shot = jax.jit(lambda m, i, c, n: m.prefill(i, c, n, last_only=True))  # one compile for the three
    for lens_, tail in (([19, 11, 4], None), ([19, 11, 4], 4), ([17, 5, 2], 4)):
        lens_ = jnp.array(lens_)
        ref_logits, ref_cache = one_shot(tiny_model, ids, tiny_model.init_cache(3, 24), lens_)
        got_logits, got_cache = run(tiny_model, ids, tiny_model.init_cache(3, 24), lens_, tail)
        assert np.abs(np.asarray(got_logits - ref_logits)).max() < 1e-4 * np.abs(np.asarray(ref_logits)).max()
        np.testing.assert_array_equal(got_cache.lengths, ref_cache.lengths)
        for a, b in zip(jax.tree.leaves(got_cache.layers), jax.tree.leaves(ref_cache.layers), strict=True):
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="prefill_chunk=0"):
        generate(tiny_model, ids, max_new_tokens=2, prefill_chunk=0)
    with pytest.raises(ValueError, match="tail_chunk=0"):
        prefill_chunked(tiny_model, ids, tiny_model.init_cache(3, 24), lens, chunk=6, tail_chunk=0)


def test_generate_asks_for_the_prefill_chunk_under_several_processes(tiny_model, monkeypatch):
    """Hosts' free memory differs and the chunk shapes the compiled program: no per-host default."""
    from hybrid_jax import PrefixCache

    pc = PrefixCache(tiny_model, max_tokens=64, block_size=tiny_model.config.page_size)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    for cache in (None, pc):  # with a prefix cache too: its calls are sized from the same default
        with pytest.raises(ValueError, match="generate: pass prefill_chunk= with several processes"):
            generate(tiny_model, jnp.zeros((1, 4), jnp.int32), max_new_tokens=2, prefix_cache=cache)
