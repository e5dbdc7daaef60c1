"""Speculative decoding: verify + commit roll the caches back exactly, greedy output equals plain greedy on every
model type, sampled output keeps plain sampling's distribution, the n-gram drafter, bad arguments."""

import contextlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from checkpoints import from_pretrained
from hybrid_jax import HybridConfig, HybridLM, generate
from hybrid_jax.quant.config import IndexerQuant, KVCacheQuant, ProjectionQuant, QuantConfig
from hybrid_jax.speculative import accept_drafts, ngram_draft, replay_drafter
from pallas_kernels import use_pallas
from tests.conftest import random_ids, variant_config
from tests.test_glm5 import glm5_cut

GEN = jax.jit(generate, static_argnames=("max_new_tokens", "top_k", "eos_id", "draft", "num_draft", "on_token"))
FIXTURES = Path(__file__).parent / "fixtures"
QUANT = QuantConfig(IndexerQuant("mxfp8"), KVCacheQuant("fp8", tile_size=16), ProjectionQuant("none"))


def oracle(reference, wrong_every: int = 3):
    """The reference continuation with every `wrong_every`-th position wrong (`replay_drafter`)."""
    return replay_drafter(reference, wrong_every)


def _reference_rows(ids, lens, out) -> np.ndarray:
    """prompt + generated tokens per row, left-aligned: [B, T + max_new]."""
    ids, lens, tokens = np.asarray(ids), np.asarray(lens), np.asarray(out.tokens)
    rows = np.zeros((ids.shape[0], ids.shape[1] + tokens.shape[1]), np.int32)
    for i, n in enumerate(lens):
        rows[i, : n + tokens.shape[1]] = np.concatenate([ids[i, :n], tokens[i]])
    return rows


# ------------------------------------------------------------------------------------------- verify + commit
@pytest.mark.parametrize(
    "make, quant",
    [
        (variant_config, None),
        (HybridConfig.tiny, QUANT),
        (glm5_cut, QUANT),
        (variant_config, "fused"),
    ],
    ids=["variant", "tiny-quantized", "glm5-quantized", "variant-fused-kda-kernel"],
)
def test_commit_leaves_the_caches_as_if_only_the_kept_tokens_were_fed(make, quant):
    """verify a block, commit a prefix per row (all, part, none; rows verifying different counts): every leaf of
    the cache equals that of a cache that was fed only the kept tokens, pool rows of the rejected ones cleared
    (KDA states and conv tails, MLA latent / rope pools, indexer keys, KPool pooled keys and tails). "fused":
    the KDA layers verify through the block kernel (`kda_verify_layer`, interpret mode), as on a GPU."""
    cfg = make()
    fused = quant == "fused"
    model = HybridLM(cfg, quant=None if fused else quant, rngs=nnx.Rngs(1))
    b, t0, t = 3, 11, 6
    ids = random_ids(40, (b, t0 + t), cfg.vocab_size)
    n_new, keep = jnp.array([6, 4, 6]), jnp.array([6, 1, 0])
    # CI time: one prefill compile (the reference's block below right-padded to the head's shape), not eager
    prefill = jax.jit(lambda m, i, c, n: m.prefill(i, c, n))
    _, base = prefill(model, ids[:, :t0], model.init_cache(b, 40), jnp.full((b,), t0))
    with use_pallas(ops=["kda_decode_layer"]) if fused else contextlib.nullcontext():
        verify = jax.jit(lambda m, i, c, n: m.verify(i, c, n))
        if fused:
            assert "kda_verify_layer" in str(jax.make_jaxpr(verify)(model, ids[:, t0:], base, n_new))
        logits, pending = verify(model, ids[:, t0:], base, n_new)
    got = jax.jit(lambda m, p, k: m.commit(p, k))(model, pending, keep)
    ref_logits, want = prefill(model, jnp.zeros_like(ids[:, :t0]).at[:, :t].set(ids[:, t0:]), base, keep)
    np.testing.assert_array_equal(np.asarray(got.lengths), t0 + np.asarray(keep))
    leaves_got, leaves_want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(leaves_got) == len(leaves_want)
    for a, w in zip(leaves_got, leaves_want, strict=True):
        assert a.shape == w.shape and a.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(w, np.float32), rtol=1e-5, atol=1e-5)
    # the verify logits are the kept tokens' logits
    for i, n in enumerate(np.asarray(keep)):
        np.testing.assert_allclose(logits[i, :n], ref_logits[i, :n], rtol=1e-4, atol=1e-4)


def test_commit_rejects_a_keep_outside_the_block(tiny_model):
    cache = tiny_model.init_cache(2, 16)
    _, pending = tiny_model.verify(random_ids(41, (2, 3)), cache, jnp.array([3, 2]))
    with pytest.raises(ValueError, match=r"keep\[1\]=3 is outside \[0, n_new=2\]"):
        tiny_model.commit(pending, jnp.array([1, 3]))
    with pytest.raises(ValueError, match="keep shape"):
        tiny_model.commit(pending, jnp.array([1]))


def test_commit_under_jit_marks_a_bad_keep_without_touching_the_row():
    """Under jit a keep outside [0, n_new] cannot raise: the row's pools stay as they were (nothing of its earlier
    tokens cleared), its length goes past max_len so its next logits are NaN; the other row commits normally.
    An MLA-only model (no KDA snapshots to turn NaN)."""
    model = _fixture_model("deepseek_v32")
    ids = random_ids(46, (2, 12), model.config.vocab_size)
    cache = model.init_cache(2, 24)
    _, cache = model.prefill(ids[:, :8], cache)
    _, pending = model.verify(ids[:, 8:], cache)
    got = jax.jit(lambda m, p, k: m.commit(p, k))(model, pending, jnp.array([-3, 4]))
    np.testing.assert_array_equal(np.asarray(got.lengths), [25, 12])
    row0 = np.asarray(got.page_table[0])  # row 0's pages
    for a, w in zip(jax.tree.leaves(got.layers), jax.tree.leaves(pending.cache.layers), strict=True):
        np.testing.assert_array_equal(np.asarray(a)[row0], np.asarray(w)[row0])
    logits, _ = jax.jit(lambda m, i, c: m.decode_step(i, c))(model, jnp.array([1, 2]), got)
    assert np.isnan(np.asarray(logits[0])).all() and np.isfinite(np.asarray(logits[1])).all()
    with pytest.raises(ValueError, match="sequence 0: 25 cached"):  # eagerly, the next call names it
        model.decode_step(jnp.array([1, 2]), got)


# ------------------------------------------------------------------------------------------- greedy == plain
def _fixture_model(name):
    return from_pretrained(FIXTURES / name, dtype=jnp.float32, progress=False)


MODELS = {
    "variant": lambda: HybridLM(variant_config(), rngs=nnx.Rngs(0)),
    "kimi_linear": lambda: _fixture_model("kimi_linear"),
    "deepseek_v32": lambda: _fixture_model("deepseek_v32"),
    "glm5_next": lambda: _fixture_model("glm5_next_a"),
}


def _accepted_draft_columns(prompt_length: int, k: int, wrong_every: int, new: int) -> list[int]:
    """The output columns that `oracle` verify steps emit as accepted drafts while a row follows the reference
    (column 0 is the prefill's token; a step at history length L drafts positions L .. L+k-1, wrong where
    divisible by wrong_every, and emits its a leading right drafts plus the model's token)."""
    cols, col = [], 1
    while col < new:
        a = 0
        while a < k and (prompt_length + col + a) % wrong_every:
            a += 1
        cols += range(col, min(col + a, new))
        col += a + 1
    return cols


@pytest.mark.parametrize("name", list(MODELS))
def test_speculative_greedy_equals_plain_greedy(name):
    """Rows of mixed prompt lengths; an oracle drafter that is right at most positions (blocks accepted whole, in
    part and not at all) and an EOS that row 0 emits as an accepted draft, inside a block; the n-gram drafter on
    one model. (tiny, with AttnRes, runs speculative greedy in the streaming and CLI tests.)"""
    model = MODELS[name]()
    vocab = model.config.vocab_size
    b, t, new, k = 3, 13, 14, 4
    pattern = random_ids(42, (b, 4), vocab)
    ids = jnp.tile(pattern, (1, 4))[:, :t]  # repetitive prompts: the n-gram drafter finds matches
    lens = jnp.array([13, 7, 10])
    plain = GEN(model, ids, prompt_lengths=lens, max_new_tokens=new)
    row0 = np.asarray(plain.tokens[0])
    # the EOS: a token row 0 emits as an accepted draft, not before it in row 0 (the variant model, whose tied
    # embeddings make it repeat its last token, has none: its EOS is its first token)
    cols = [c for c in _accepted_draft_columns(13, k, 3, new) if c >= 3 and row0[c] not in row0[:c]]
    assert cols or name == "variant"
    col = cols[0] if cols else 0
    eos = int(row0[col])
    # plain greedy with this EOS: the same tokens up to each row's first EOS, pad (0) after it
    tokens = np.asarray(plain.tokens).copy()
    hit = tokens == eos
    stop = np.where(hit.any(axis=1), hit.argmax(axis=1) + 1, new)
    tokens[np.arange(new)[None, :] >= stop[:, None]] = 0
    assert stop[0] == col + 1
    draft = oracle(_reference_rows(ids, lens, plain))
    spec = GEN(model, ids, prompt_lengths=lens, max_new_tokens=new, eos_id=eos, draft=draft, num_draft=k)
    np.testing.assert_array_equal(spec.tokens, tokens)
    np.testing.assert_array_equal(spec.lengths, stop)
    accepted, drafted = np.asarray(spec.accepted), np.asarray(spec.drafted)
    long = np.asarray(spec.lengths) >= 8  # rows that ran several steps (the EOS may stop other rows early)
    assert long.any() and (accepted[long] > 0).all() and (accepted < drafted).any()
    # each step emits its accepted drafts and the model's token, except a last step that an EOS or the budget
    # ends inside the accepted drafts; so the steps (k drafts each) are lengths - 1 - accepted, or one more
    extra = drafted // k - (np.asarray(spec.lengths) - 1 - accepted)
    assert (drafted % k == 0).all() and set(extra.tolist()) <= {0, 1}
    assert extra[0] == (1 if cols else 0)  # row 0 ended on its EOS emitted as an accepted draft
    if name == "variant":  # the n-gram drafter (also in the CLI test), on the cheapest model
        ngram = GEN(model, ids, prompt_lengths=lens, max_new_tokens=new, draft="ngram", num_draft=3)
        np.testing.assert_array_equal(ngram.tokens, plain.tokens)
        np.testing.assert_array_equal(ngram.lengths, plain.lengths)
        assert (np.asarray(ngram.accepted) > 0).all()  # it repeats its last token: the n-gram drafts are right


@pytest.mark.slow
def test_speculative_streams_like_plain_decoding(tiny_model):
    """on_token sees the same (step, tokens) sequence as plain decoding, rows stopping at different steps (an
    EOS in row 0 only)."""
    seen = []
    ids = random_ids(43, (2, 5))
    lens = jnp.array([5, 3])
    free = GEN(tiny_model, ids, prompt_lengths=lens, max_new_tokens=9)
    row0, row1 = np.asarray(free.tokens)
    col = next(c for c, tok in enumerate(row0) if c >= 2 and tok not in row1 and tok not in row0[:c])
    # plain decoding streams step s with each row's token, pad (0) once the row has stopped (test_generate)
    want = np.stack([np.where(np.arange(9) <= col, row0, 0), row1], axis=1)  # [step, row]
    draft = oracle(_reference_rows(ids, lens, free))
    kw = dict(prompt_lengths=lens, max_new_tokens=9, eos_id=int(row0[col]), draft=draft)
    GEN(tiny_model, ids, **kw, on_token=lambda s, t: seen.append((int(s), t)))
    jax.effects_barrier()
    assert [s for s, _ in seen] == list(range(9)) and col < 8
    np.testing.assert_array_equal(np.stack([t for _, t in seen]), want)


# ------------------------------------------------------------------------------------------- sampling
def _chi2_sf(stat: float, df: int) -> float:
    return float(jax.scipy.special.gammaincc(df / 2, stat / 2))


def test_rejection_rule_keeps_the_target_distribution():
    """accept_drafts on fixed target distributions (temperature, top_k / top_p filtering) and fixed drafts,
    200K rows: the first emitted token follows p_0, the second (where the first draft was accepted) p_1, the
    model's token after two accepted drafts p_2 — chi-square goodness of fit at significance 0.001 — whether the
    draft is likely, unlikely or filtered out."""
    v, k, n = 6, 2, 200_000
    base = jnp.log(jnp.array([[0.30, 0.25, 0.2, 0.1, 0.1, 0.05], [0.05, 0.1, 0.4, 0.3, 0.1, 0.05],
                              [0.2, 0.2, 0.2, 0.2, 0.1, 0.1]]))  # fmt: skip
    from hybrid_jax.generate import filtered_logits

    for temperature, top_k, top_p, drafts in (
        (1.0, None, None, (0, 2)),
        (0.7, 4, None, (5, 3)),
        (1.3, None, 0.8, (1, 2)),
    ):
        logits = jnp.broadcast_to(base, (n, k + 1, v))
        d = jnp.broadcast_to(jnp.array(drafts, jnp.int32), (n, k))
        a, y = accept_drafts(logits, d, jax.random.key(5), temperature=temperature, top_k=top_k, top_p=top_p)
        a, y = np.asarray(a), np.asarray(y)
        first = np.where(a >= 1, drafts[0], y)
        second = np.where(a >= 2, drafts[1], y)[a >= 1]
        bonus = y[a == 2]  # both drafts accepted: the model's token after them, from p_2
        p = np.asarray(jax.nn.softmax(filtered_logits(base, temperature, top_k, top_p), axis=-1))
        for got, probs in ((first, p[0]), (second, p[1]), (bonus, p[2])):
            counts = np.bincount(got, minlength=v)
            support = probs > 0
            if got.size == 0:  # a draft outside the filtered support: never accepted
                assert p[0][drafts[0]] == 0 or p[1][drafts[1]] == 0
                continue
            assert counts[~support].sum() == 0  # filtered-out tokens are never emitted
            expected = probs[support] * got.size
            stat = float(((counts[support] - expected) ** 2 / expected).sum())
            assert _chi2_sf(stat, int(support.sum()) - 1) > 1e-3, (temperature, top_k, top_p, counts, expected)


@pytest.mark.slow
def test_speculative_sampling_matches_plain_sampling_end_to_end():
    """Many rows of one prompt through generate: the joint distribution of the first three tokens with the
    oracle drafter (which accepts and rejects) against plain sampling, a chi-square homogeneity test at 0.001
    over the sequences either side saw at least 10 times."""
    cfg = HybridConfig.tiny().replace(vocab_size=16, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = HybridLM(cfg, rngs=nnx.Rngs(3))
    n = 3072
    ids = jnp.broadcast_to(random_ids(44, (1, 6), 16), (n, 6))
    kw = dict(max_new_tokens=3, temperature=0.8, top_k=4)
    plain = GEN(model, ids, rng=jax.random.key(0), **kw)
    greedy = GEN(model, ids[:1], max_new_tokens=3)
    draft = oracle(np.broadcast_to(_reference_rows(ids[:1], [6], greedy), (n, 9)), wrong_every=2)
    spec = GEN(model, ids, rng=jax.random.key(1), draft=draft, num_draft=2, **kw)
    assert np.asarray(spec.accepted).sum() > n // 4 and np.asarray(spec.accepted).sum() < np.asarray(spec.drafted).sum()

    def code(tokens):
        t = np.asarray(tokens)
        return t[:, 0] * 256 + t[:, 1] * 16 + t[:, 2]

    a, b = code(plain.tokens), code(spec.tokens)
    keys = np.union1d(a, b)
    ca = np.array([(a == key).sum() for key in keys])
    cb = np.array([(b == key).sum() for key in keys])
    big = (ca + cb) >= 20
    rest = np.array([ca[~big].sum(), cb[~big].sum()])
    table = np.concatenate([np.stack([ca[big], cb[big]], axis=1), rest[None]], axis=0)
    table = table[table.sum(1) > 0]
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    assert table.shape[0] > 4
    assert _chi2_sf(stat, table.shape[0] - 1) > 1e-3, (stat, table)


# ------------------------------------------------------------------------------------------- drafter, errors
def test_ngram_draft_takes_the_longest_latest_match_and_repeats_its_period():
    h = jnp.array(
        [
            [5, 6, 7, 1, 2, 3, 9, 9, 1, 2, 3, 0, 0],  # "1 2 3" occurred at 3: continue with 9 9 1 2 3 ...
            [4, 4, 4, 8, 4, 4, 0, 0, 0, 0, 0, 0, 0],  # "4 4" latest earlier at 1 -> 8 4 4 8 (period 3)
            [1, 2, 3, 4, 5, 0, 0, 0, 0, 0, 0, 0, 0],  # no earlier match: the last token repeated
            [7, 3, 7, 3, 7, 0, 0, 0, 0, 0, 0, 0, 0],  # "3 7" ... latest "7 3 7" at 0 -> 3 7 3 7
        ],
        jnp.int32,
    )
    lengths = jnp.array([11, 6, 5, 5])
    got = np.asarray(ngram_draft(h, lengths, 4))
    np.testing.assert_array_equal(got, [[9, 9, 1, 2], [8, 4, 4, 8], [5, 5, 5, 5], [3, 7, 3, 7]])


def test_bad_speculative_arguments_raise_naming_the_value(tiny_model):
    ids = random_ids(45, (1, 4))
    with pytest.raises(ValueError, match="num_draft=0"):
        generate(tiny_model, ids, max_new_tokens=2, draft="ngram", num_draft=0)
    with pytest.raises(ValueError, match="draft='mtp'"):
        generate(tiny_model, ids, max_new_tokens=2, draft="mtp")
    with pytest.raises(ValueError, match="draft='medusa'"):
        generate(tiny_model, ids, max_new_tokens=2, draft="medusa")
    limit = tiny_model.config.max_position_embeddings
    with pytest.raises(ValueError, match="num_draft=4 exceeds max_position_embeddings"):
        generate(tiny_model, ids, max_new_tokens=limit - 4, draft="ngram", num_draft=4)
