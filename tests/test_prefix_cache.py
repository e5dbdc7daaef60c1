"""Prefix caching: a prefill through the cache equals a plain prefill for prompts sharing none, part or all of a
stored prefix (every cache leaf, every model type), hits / misses / evictions counted, shared pages never
written, generate's outputs unchanged under jit (plain and speculative), bad arguments."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from checkpoints import from_pretrained
from hybrid_jax import HybridConfig, HybridLM, PrefixCache, generate
from hybrid_jax.cache import AttnState, KDAState, MLAState
from hybrid_jax.quant.config import IndexerQuant, KVCacheQuant, ProjectionQuant, QuantConfig
from tests.conftest import random_ids, rel_err, variant_config
from tests.test_glm5 import glm5_cut
from tests.test_qwen3_next import qwen_tiny

FIXTURES = Path(__file__).parent / "fixtures"
QUANT = QuantConfig(IndexerQuant("mxfp8"), KVCacheQuant("fp8", tile_size=16), ProjectionQuant("none"))
STATIC = ("max_new_tokens", "top_k", "eos_id", "draft", "num_draft")
GEN = jax.jit(generate, static_argnames=STATIC)
GEN_PC = jax.jit(generate, static_argnames=STATIC, donate_argnames=("prefix_cache",))


PREFILL = jax.jit(
    lambda p, m, i, n, max_len, chunk=None: p.prefill(m, i, n, max_len=max_len, chunk=chunk),
    static_argnames=("max_len", "chunk"),
)
PLAIN = jax.jit(lambda m, i, c, n: m.prefill(i, c, n, last_only=True))
STEP = jax.jit(lambda m, i, c: m.decode_step(i, c))
PLAIN_ALL = jax.jit(lambda m, i, c, n: m.prefill(i, c, n))


def _valid_rows(cache, lengths):
    """Every pool's rows at the positions each sequence holds, per row: [(layer, field, row, rows)]."""
    out = []
    for li, st in enumerate(cache.layers):
        if isinstance(st, KDAState):
            continue
        for name in ("latent", "rope", "index_k") if isinstance(st, MLAState) else ("k", "v"):
            pool = getattr(st, name)
            if pool is None:
                continue
            per_token = cache.page_size // pool.values.shape[1]  # 1, or the KPool size for pooled keys
            rows = np.asarray(pool.gather(cache.page_table, jnp.float32))
            out += [(li, name, b, rows[b, : int(n) // per_token]) for b, n in enumerate(np.asarray(lengths))]
    return out


def _per_seq_leaves(cache):
    leaves = []
    for st in cache.layers:
        if isinstance(st, KDAState):
            leaves += [st.conv, st.recurrent]
        elif isinstance(st, MLAState) and st.index_tail is not None:
            leaves.append(st.index_tail)
    return [np.asarray(x, np.float32) for x in leaves]


def assert_same_cache(got, want, lengths, tol):
    np.testing.assert_array_equal(got.lengths, want.lengths)
    for a, w in zip(_per_seq_leaves(got), _per_seq_leaves(want), strict=True):
        np.testing.assert_allclose(a, w, rtol=tol, atol=tol)
    for (li, name, b, a), (_, _, _, w) in zip(_valid_rows(got, lengths), _valid_rows(want, lengths), strict=True):
        np.testing.assert_allclose(a, w, rtol=tol, atol=tol, err_msg=f"layer {li} {name} row {b}")


def _pool_leaves(state: MLAState | AttnState) -> list:
    if isinstance(state, AttnState):
        return jax.tree.leaves((state.k, state.v))
    return jax.tree.leaves((state.latent, state.rope, state.index_k))


def _prompts(seed, blk, vocab):
    """Two calls' prompts over block size blk. Call 1 (cold): rows 0 and 1 share 3 blocks (stored once), row 2 is
    shorter than a block, row 3 has one block and a token. Call 2: all of row 0's stored prefix + new tokens, part
    of it, a prompt equal to a stored one of whole blocks (its last block is recomputed: the last token's logits
    are the output), none."""
    base = np.array(random_ids(seed, (4, 6 * blk), vocab))
    first = np.array(random_ids(seed + 1, (4, 6 * blk), vocab))
    first[1, : 3 * blk] = first[0, : 3 * blk]
    lens1 = np.array([5 * blk + 3, 4 * blk, blk - 3, blk + 1])
    second = base.copy()
    second[0, : 5 * blk] = first[0, : 5 * blk]  # 5 stored blocks + 1 new token ... + more
    second[1, : 2 * blk] = first[0, : 2 * blk]  # 2 of them, then 4 different blocks
    second[2, : 4 * blk] = first[1, : 4 * blk]  # exactly row 1's stored prompt
    lens2 = np.array([5 * blk + 7, 6 * blk, 4 * blk, 2 * blk + 1])
    return (first, lens1), (second, lens2)


def _model(make, quant):
    if isinstance(make, str):
        return from_pretrained(FIXTURES / make, dtype=jnp.float32, progress=False)
    return HybridLM(make(), quant=quant, rngs=nnx.Rngs(3))


@pytest.mark.parametrize(
    "make, quant, tail_chunk, chunk_blocks",
    [(variant_config, None, 5, 1), (variant_config, None, None, 2), (glm5_cut, QUANT, None, 3),
     (qwen_tiny, QUANT, None, 2)],
    ids=["variant-tail-chunks", "variant-2-block-calls", "glm5-quantized-3-block-calls", "qwen3-next-quantized"],
)  # fmt: skip
def test_prefill_through_the_cache_equals_a_plain_prefill(make, quant, tail_chunk, chunk_blocks, monkeypatch):
    """Float32. Each call's logits and every cache leaf (KDA states and conv tails, KPool tails; every pool row —
    MLA, indexer, GQA K/V — the sequences hold) equal a one-shot prefill's; a hit gives the logits the miss of the
    same prompt gave; hit / miss tokens counted exactly; the stored blocks' pages are untouched by the decode steps
    after. Calls of `chunk_blocks` blocks (stage 1, snapshots at each block end inside: rows with 4-5 new blocks
    take 1-2 of them, the shorter rows their whole rest in a call that runs anyway, then block calls; call 2's
    row 1 resumes after 2 hit blocks in them), block calls alone with 1; the first variant prefills each prompt's
    partial last block in calls of 5 tokens."""
    snapshot_calls = []
    plain_prefill = HybridLM.prefill

    def prefill(self, *a, snapshot_every=None, **kw):  # counts the traced calls that take snapshots
        snapshot_calls.append(snapshot_every)
        return plain_prefill(self, *a, snapshot_every=snapshot_every, **kw)

    monkeypatch.setattr(HybridLM, "prefill", prefill)
    model = _model(make, quant)
    cfg = model.config
    blk = 2 * cfg.page_size
    (ids1, lens1), (ids2, lens2) = _prompts(7, blk, cfg.vocab_size)
    max_len = 6 * blk + 4
    pc = PrefixCache(model, max_tokens=40 * blk, block_size=blk, tail_chunk=tail_chunk)
    results = []
    for ids, lens in ((ids1, lens1), (ids2, lens2)):
        args = (pc, model, jnp.asarray(ids), jnp.asarray(lens))
        logits, cache, pc = PREFILL(*args, max_len=max_len, chunk=chunk_blocks * blk)
        # the plain cache with as many pages as the cache's pools (its extra pages unused): STEP compiles once
        pages = next(x.shape[0] for st in cache.layers if not isinstance(st, KDAState) for x in _pool_leaves(st))
        plain_cache = model.init_cache(len(lens), max_len, num_pages=pages)
        want_logits, want = PLAIN(model, jnp.asarray(ids), plain_cache, jnp.asarray(lens))
        assert rel_err(logits, want_logits) < 2e-5
        assert_same_cache(cache, want, lens, 2e-5)
        # decode two steps: the shared pages stay as they were stored
        before = [np.asarray(x) for st in cache.layers if not isinstance(st, KDAState) for x in _pool_leaves(st)]
        for tok in (5, 9):
            got_l, cache = STEP(model, jnp.full((len(lens),), tok), cache)
            want_l, want = STEP(model, jnp.full((len(lens),), tok), want)
            assert rel_err(got_l, want_l) < 2e-5
        pc = pc.release(cache)
        pages = np.nonzero(np.repeat(np.asarray(pc.valid), blk // cfg.page_size))[0]
        after = [np.asarray(x) for st in pc.store if not isinstance(st, KDAState) for x in _pool_leaves(st)]
        assert len(after) == len(before) > 0
        for a, w in zip(after, before, strict=True):  # every pool: latent, rope, indexer keys, their scales
            np.testing.assert_array_equal(a[pages], w[pages])
        results.append(logits)
    # stage 1 ran (calls of chunk_blocks > 1 blocks with snapshots at each block end) exactly when asked for
    assert (blk in snapshot_calls) == (chunk_blocks > 1), snapshot_calls
    s = pc.stats()
    # call 1: nothing stored; rows 0, 1 store 5 + 1 blocks (3 shared), row 2 none, row 3 one.
    # call 2: row 0 hits 5 blocks, row 1 2, row 2 3 (of its 4 stored: the last is recomputed), row 3 none.
    hits = (5 + 2 + 3) * blk
    assert s["hit_tokens"] == hits
    assert s["miss_tokens"] == int(lens1.sum()) + int(lens2.sum()) - hits
    assert s["evictions"] == 0
    # a hit resumes from the miss's own state: row 2 of call 2 is row 1 of call 1
    np.testing.assert_allclose(np.asarray(results[1][2]), np.asarray(results[0][1]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "make, every", [(variant_config, 6), (glm5_cut, 6), (qwen_tiny, 6), (variant_config, 2)],
    ids=["variant", "glm5", "qwen3-next", "variant-every-2"],
)  # fmt: skip
def test_prefill_snapshots_equal_the_states_of_shorter_prefills(make, every):
    """model.prefill(snapshot_every=E) after 3 cached tokens: snapshot j of each layer (KDA state and conv tail,
    KPool tail: pools of 4, so 6-token ends leave partial pools) equals the per-sequence state of a prefill of the
    first E·(j + 1) tokens of the call (j < 3), for each row that has them (row 1 has 13 of 20); the logits and
    the cache equal the prefill's without snapshots. E = 2 is shorter than the conv tail (W - 1 = 3): the first
    snapshot's tail still holds a cached input."""
    model = HybridLM(make(), rngs=nnx.Rngs(3))
    assert every != 2 or model.config.kda_conv_size - 1 > every
    ids = jnp.asarray(random_ids(4, (2, 23), model.config.vocab_size))
    lens = jnp.array([20, 13])
    _, cache0 = PLAIN_ALL(model, ids[:, :3], model.init_cache(2, 32), jnp.array([3, 3]))
    snap = jax.jit(lambda m, i, c, n: m.prefill(i, c, n, snapshot_every=every))
    logits, cache, snaps = snap(model, ids[:, 3:], cache0, lens)
    want_logits, want = PLAIN_ALL(model, ids[:, 3:], cache0, lens)
    assert rel_err(logits, want_logits) < 1e-6
    assert_same_cache(cache, want, np.asarray(want.lengths), 1e-6)
    assert len(snaps) == model.config.num_layers
    checked = 0
    for j in range(3):
        n = every * (j + 1)
        _, part = PLAIN_ALL(model, ids[:, 3:], cache0, jnp.minimum(lens, n))  # n real tokens, one compiled shape
        for li, (st, snap) in enumerate(zip(part.layers, snaps, strict=True)):
            if isinstance(st, KDAState):
                pairs = [(st.conv, snap.conv[:, j]), (st.recurrent, snap.recurrent[:, j])]
            elif isinstance(st, MLAState) and st.index_tail is not None:
                pairs = [(st.index_tail, snap[:, j])]
            else:
                assert snap is None, li
                continue
            for want_leaf, got_leaf in pairs:
                for r in range(2):
                    if n <= int(lens[r]):
                        np.testing.assert_allclose(got_leaf[r], want_leaf[r], rtol=1e-5, atol=1e-5, err_msg=f"{li} {j}")
                        checked += 1
    assert checked > 0


def test_lru_eviction_keeps_recent_prefixes_and_results():
    """A cache of 6 blocks, one prompt of 2 blocks + 1 token a call (3 blocks each: 2 stored, 1 private). The
    least recently used chain loses its deepest block first; a prefix whose block was evicted hits only up to
    it; every call's logits equal a plain prefill's."""
    model = _model(variant_config, None)
    blk = 2 * model.config.page_size
    t = 2 * blk + 1
    pc = PrefixCache(model, max_tokens=6 * blk, block_size=blk)
    a, b, c = (jnp.asarray(random_ids(s, (1, t), model.config.vocab_size)) for s in (11, 12, 13))
    lens = jnp.array([t])
    expected = [  # (prompt, hit blocks of this call, evictions so far)
        (a, 0, 0),  # stores A0 A1
        (b, 0, 0),  # stores B0 B1; 2 slots free
        (a, 2, 0),  # touches A
        (c, 0, 1),  # needs 3: the 2 free + B1 (B is older than A)
        (b, 1, 2),  # hits B0; needs 2: the free one + A1 (A older than C)
        (a, 1, 3),  # hits A0; needs 2: the free one + C1 (C older than B)
    ]
    hits = 0
    for i, (ids, hit, evictions) in enumerate(expected):
        logits, cache, pc = PREFILL(pc, model, ids, lens, max_len=t)
        want, _ = PLAIN(model, ids, model.init_cache(1, t), lens)
        assert rel_err(logits, want) < 2e-5, i
        pc = pc.release(cache)
        hits += hit * blk
        s = pc.stats()
        assert (s["hit_tokens"], s["evictions"]) == (hits, evictions), (i, s)
        assert s["cached_tokens"] == min(2 * (i + 1), {0: 2, 1: 4, 2: 4, 3: 5, 4: 5, 5: 5}[i]) * blk, (i, s)


GEN_MODELS = {"kimi_linear": lambda: _model("kimi_linear", None), "deepseek_v32": lambda: _model("deepseek_v32", None)}


@pytest.mark.parametrize("name", list(GEN_MODELS))
def test_generate_with_a_prefix_cache_equals_generate_without(name):
    """jit(generate) with the cache donated, two calls sharing prefixes (none, part, all of a stored prompt, rows
    of mixed lengths), the cache just big enough for one call so that the second evicts: greedy tokens equal
    generate without a cache, with speculative decoding too (kimi_linear); hits and evictions counted. (The
    variant and glm5 models: the prefill test.)"""
    model = GEN_MODELS[name]()
    cfg = model.config
    blk = cfg.page_size
    vocab, new = cfg.vocab_size, 6
    base = np.array(random_ids(21, (3, 3 * blk), vocab))
    calls = [
        (base, np.array([3 * blk, 2 * blk + 5, blk - 1])),
        (np.stack([base[1], base[0], base[2]]), np.array([2 * blk + 7, 3 * blk, 2 * blk])),
    ]
    draft = "ngram" if name == "kimi_linear" else None
    max_len = 3 * blk + new + (4 if draft else 0)
    pc = PrefixCache(model, max_tokens=3 * -(-max_len // blk) * blk, block_size=blk)
    for ids, lens in calls:
        ids, lens = jnp.asarray(ids), jnp.asarray(lens)
        want = GEN(model, ids, prompt_lengths=lens, max_new_tokens=new, draft=draft)
        got = GEN_PC(model, ids, prompt_lengths=lens, max_new_tokens=new, draft=draft, prefix_cache=pc)
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_array_equal(got.lengths, want.lengths)
        pc = got.prefix_cache
    # call 1 stores base[0]'s 3 blocks and base[1]'s first 2; call 2: row 0 (base[1]) hits 2, row 1 (base[0]) 2
    # (its third is its last token's block), row 2 (base[2], 2 blocks now) none; the 12 slots hold 5 stored
    # blocks and call 2 needs 8 fresh ones: base[0]'s third block, the one not matched, is evicted
    assert (pc.stats()["hit_tokens"], pc.stats()["evictions"]) == (4 * blk, 1)


def test_prefix_cache_bad_arguments():
    model = _model(variant_config, None)
    g = model.config.page_size
    with pytest.raises(ValueError, match="block_size=12 must be a positive multiple of the page size 8"):
        PrefixCache(model, max_tokens=1024, block_size=12)
    with pytest.raises(ValueError, match="tail_chunk=17 must be an int in \\[1, block_size=16\\]"):
        PrefixCache(model, max_tokens=1024, block_size=2 * g, tail_chunk=17)
    with pytest.raises(ValueError, match="max_tokens=8 must be an int of at least one block"):
        PrefixCache(model, max_tokens=8, block_size=2 * g)
    pc = PrefixCache(model, max_tokens=4 * g, block_size=2 * g)
    ids = random_ids(1, (2, 3 * g), model.config.vocab_size)
    with pytest.raises(ValueError, match="a batch of 2 rows of up to max_len=30 tokens needs 4"):
        pc.prefill(model, ids, max_len=30)
    with pytest.raises(ValueError, match="max_len=10 must be an int in"):
        pc.prefill(model, ids, max_len=10)
    with pytest.raises(ValueError, match="lengths \\[0, 3\\] must lie in"):
        pc.prefill(model, ids[:, :3], jnp.array([0, 3]), max_len=8)
    other = HybridLM(HybridConfig.tiny(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="built for another model: layer_types=\\('linear', 'linear', 'sparse'"):
        generate(other, ids[:1], max_new_tokens=2, prefix_cache=pc)
    same_config = HybridLM(variant_config(), rngs=nnx.Rngs(5))
    same_config.embed_tokens.embedding[...] = model.embed_tokens.embedding[...]  # only the other weights differ
    with pytest.raises(ValueError, match="built for other weights of this config"):
        generate(same_config, ids[:1], max_new_tokens=2, prefix_cache=pc)
    with pytest.raises(ValueError, match="prefill_chunk=24: with a prefix cache the prompt is prefilled in calls"):
        generate(model, ids[:1], max_new_tokens=2, prefix_cache=pc, prefill_chunk=24)
    with pytest.raises(ValueError, match="chunk=8 must be a positive multiple of the prefix cache's block_size=16"):
        pc.prefill(model, ids[:1], max_len=30, chunk=8)
    with pytest.raises(ValueError, match="snapshot_every=0 must be a positive int"):
        model.prefill(ids[:1], model.init_cache(1, 30), snapshot_every=0)
    _, cache, lent = pc.prefill(model, ids[:1, :5], max_len=8)
    with pytest.raises(ValueError, match="prefix_cache is lent to a running cache"):
        lent.prefill(model, ids[:1, :5], max_len=8)
    with pytest.raises(ValueError, match="release: this prefix_cache lends no pools"):
        pc.release(cache)
    back = lent.release(cache)
    assert back.stats()["miss_tokens"] == 5
    assert repr(back) == "PrefixCache(0 of 2 blocks of 16 tokens stored, tail_chunk=16)"
    assert repr(lent).endswith(", lent)")
