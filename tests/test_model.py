"""Model-level equivalences: cached decoding vs the full forward, chunked and padded prefill, sparse layers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_jax import HybridConfig, HybridLM
from hybrid_jax.cache import StepInfo
from hybrid_jax.layers.common import DTypes
from hybrid_jax.layers.mla import MultiHeadLatentAttention
from hybrid_jax.quant.config import QuantConfig
from tests.conftest import prefill_then_decode, random_ids, rel_err, variant_config


@pytest.fixture(scope="module")
def variant_model():
    return HybridLM(variant_config(), rngs=nnx.Rngs(1))


@pytest.mark.slow
@pytest.mark.parametrize("which", ["tiny", "variant"])
def test_token_by_token_decode_reproduces_full_forward(which, tiny_model, variant_model, jitted):
    model = tiny_model if which == "tiny" else variant_model
    ids = random_ids(7, (2, 14))
    full = jitted["forward"](model, ids)
    stepped, cache = prefill_then_decode(model, ids, jitted, 5, 16)
    assert rel_err(stepped, full) < 1e-4
    np.testing.assert_array_equal(cache.lengths, [14, 14])


@pytest.mark.slow
def test_prefill_in_three_chunks_equals_one(tiny_model, jitted):
    ids = random_ids(8, (2, 13))
    one, cache1 = jitted["prefill"](tiny_model, ids, tiny_model.init_cache(2, 16), jnp.array([13, 13]))
    cache = tiny_model.init_cache(2, 16)
    parts, start = [], 0
    for n in (6, 3, 4):
        chunk = jnp.zeros((2, 6), jnp.int32).at[:, :n].set(ids[:, start : start + n])
        lg, cache = jitted["prefill"](tiny_model, chunk, cache, jnp.array([n, n]))
        parts.append(lg[:, :n])
        start += n
    assert rel_err(jnp.concatenate(parts, axis=1), one) < 1e-5
    for a, b in zip(jax.tree_util.tree_leaves(cache.layers), jax.tree_util.tree_leaves(cache1.layers), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_padded_batch_equals_each_prompt_alone(tiny_model, jitted):
    lens = [13, 5, 9]
    ids = random_ids(9, (3, 13))
    ids = jnp.where(jnp.arange(13)[None] < jnp.array(lens)[:, None], ids, 258)  # pad id in the padding
    cache = tiny_model.init_cache(3, 16)
    logits, cache = jitted["prefill"](tiny_model, ids, cache, jnp.array(lens))
    nxt = random_ids(10, (3, 2))
    dec = []
    for j in range(2):
        lg, cache = jitted["decode"](tiny_model, nxt[:, j], cache)
        dec.append(lg)
    for i, n in enumerate(lens):
        alone = jitted["forward"](tiny_model, jnp.concatenate([ids[i : i + 1, :n], nxt[i : i + 1]], axis=1))[0]
        assert rel_err(logits[i, :n], alone[:n]) < 1e-5
        assert rel_err(jnp.stack([d[i] for d in dec]), alone[n:]) < 1e-4
    np.testing.assert_array_equal(cache.lengths, [15, 7, 11])


def test_scattered_page_table_gives_the_same_logits(tiny_model, jitted):
    ids = random_ids(11, (2, 9))
    ref = jitted["forward"](tiny_model, ids)
    pps = 2  # 16 tokens / page size 8
    table = np.random.default_rng(0).permutation(7)[:4].reshape(2, pps)
    cache = tiny_model.init_cache(2, 16, num_pages=7, page_table=table)
    logits, _ = jitted["prefill"](tiny_model, ids, cache, jnp.array([9, 9]))
    assert rel_err(logits, ref) < 1e-5


# ----------------------------------------------------------------------------- sparse MLA layers
def _info(b, t, start=0):
    """Rows of one page each (page b holds sequence b); `start` tokens already cached."""
    pos = start + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return StepInfo(
        positions=pos,
        valid=jnp.ones((b, t), bool),
        n_new=jnp.full((b,), t, jnp.int32),
        page_table=jnp.arange(b, dtype=jnp.int32)[:, None],
        kv_lengths=jnp.full((b,), start + t, jnp.int32),
        mode="prefill" if t > 1 else "decode",
    )


def _sparse_and_dense(cfg):
    sparse = MultiHeadLatentAttention(cfg, DTypes(), QuantConfig(), sparse=True, rngs=nnx.Rngs(5))
    dense = MultiHeadLatentAttention(cfg, DTypes(), QuantConfig(), sparse=False, rngs=nnx.Rngs(6))
    state = nnx.state(sparse)
    del state["indexer"]
    nnx.update(dense, state)
    return sparse, dense


def test_sparse_layer_with_topk_covering_the_context_equals_dense(tiny_cfg):
    cfg = tiny_cfg.replace(index_topk=16)
    sparse, dense = _sparse_and_dense(cfg)
    x = jax.random.normal(jax.random.key(12), (2, 12, cfg.hidden_size))
    info = _info(2, 12)
    ys = sparse(x, info, None)[0]
    yd = dense(x, info, None)[0]
    assert rel_err(ys, yd) < 1e-5


def _perturb(state, rows, delta):
    """Add delta [n, L+R] to the cached [latent | rope] rows of page 0 (the MLA keys and values)."""
    lat = state.latent.values.shape[-1]
    latent = state.latent.replace(values=state.latent.values.at[0, rows].add(delta[:, :lat]))
    rope = state.rope.replace(values=state.rope.values.at[0, rows].add(delta[:, lat:]))
    return state.replace(latent=latent, rope=rope)


@pytest.mark.slow
def test_small_topk_ignores_unselected_keys(tiny_cfg):
    cfg = tiny_cfg.replace(index_topk=3)
    layer, _ = _sparse_and_dense(cfg)
    b, t, g = 1, 12, 16
    x = jax.random.normal(jax.random.key(13), (b, t + 1, cfg.hidden_size))
    state = layer.init_state(1, g, jnp.float32, 1)  # one page of 16 slots
    state = layer(x[:, :t], _info(b, t), state)[1]
    info = _info(b, 1, start=t)
    idx, _, _ = layer.indexer(x[:, t:], layer.q_a_layernorm(layer.q_a_proj(x[:, t:])), info, state.index_k)
    selected = set(np.asarray(idx).ravel().tolist()) - {-1}
    assert len(selected) == 3
    unselected = jnp.array([p for p in range(t + 1) if p not in selected])
    noise = jax.random.normal(jax.random.key(14), (len(unselected), cfg.latent_dim))
    y = layer(x[:, t:], info, state)[0]
    y_noisy = layer(x[:, t:], info, _perturb(state, unselected, noise))[0]
    np.testing.assert_allclose(y_noisy, y, rtol=0, atol=1e-6)
    one_selected = jnp.array([sorted(selected)[0]])
    y_hit = layer(x[:, t:], info, _perturb(state, one_selected, jnp.ones((1, cfg.latent_dim))))[0]
    assert not np.allclose(y_hit, y, atol=1e-4)


# ----------------------------------------------------------------------------- bad input
def test_bad_input_raises_naming_the_value(tiny_model):
    with pytest.raises(ValueError, match="token id 288 is outside the vocabulary"):
        tiny_model(jnp.array([[1, 288]]))
    with pytest.raises(ValueError, match="token id -3"):
        tiny_model(jnp.array([[-3, 4]]))
    with pytest.raises(ValueError, match=r"time >= 1, got shape \(1, 0\)"):
        tiny_model(jnp.zeros((1, 0), jnp.int32))
    cache = tiny_model.init_cache(1, 8)
    with pytest.raises(ValueError, match="0 cached \\+ 10 new tokens exceed the cache capacity max_len=8"):
        tiny_model.prefill(random_ids(0, (1, 10)), cache)
    with pytest.raises(ValueError, match="max_len=5000"):
        tiny_model.init_cache(1, 5000)
    with pytest.raises(ValueError, match="page_table entries span"):
        tiny_model.init_cache(1, 8, num_pages=2, page_table=[[5]])


@pytest.mark.slow
def test_overflow_under_jit_is_nan_not_silent(tiny_model):
    """Under jit a row that would overflow its cache takes none of its tokens (nothing clamped: its cache,
    state and length stay as they were) and gets NaN logits; the other rows are unaffected."""
    f = jax.jit(lambda m, ids, c, n: m.prefill(ids, c, n))
    cache = f(tiny_model, random_ids(2, (2, 3)), tiny_model.init_cache(2, 8), jnp.array([3, 3]))[1]
    logits, new = f(tiny_model, random_ids(1, (2, 10)), cache, jnp.array([10, 2]))
    assert np.isnan(np.asarray(logits[0])).all()
    assert np.isfinite(np.asarray(logits[1, :2])).all()
    np.testing.assert_array_equal(new.lengths, [3, 5])
    for before, after in zip(jax.tree.leaves(cache.layers), jax.tree.leaves(new.layers), strict=True):
        if before.shape[0] == 2:  # per-sequence leaves (KDA conv tail and state): row 0 untouched
            np.testing.assert_array_equal(np.asarray(after[0]), np.asarray(before[0]))
    pools = [(b, a) for b, a in zip(jax.tree.leaves(cache.layers), jax.tree.leaves(new.layers), strict=True)
             if b.shape[0] != 2]  # fmt: skip
    rows0 = np.asarray(cache.page_table[0])  # row 0's pages: unchanged
    for before, after in pools:
        np.testing.assert_array_equal(np.asarray(after[rows0]), np.asarray(before[rows0]))


def _dense_cfg():
    """The tiny model with its sparse layers made dense: the dense MLA prefill's memory is what is measured."""
    cfg = HybridConfig.tiny()
    dense = tuple("full" if t == "sparse" else t for t in cfg.layer_types)
    return cfg.replace(layer_types=dense, max_position_embeddings=4096)


def test_prefill_against_a_long_cache_in_key_blocks_equals_one_block(monkeypatch):
    """A dense MLA prefill whose cache spans more than PREFILL_KEY_BLOCK keys expands and attends block by
    block, merging by LSE: the same logits, cache and next decode step as the one-block form."""
    from hybrid_jax.layers import mla

    model = HybridLM(_dense_cfg(), rngs=nnx.Rngs(0))
    head, chunk = random_ids(30, (2, 29)), random_ids(31, (2, 11))

    def run():
        f = jax.jit(lambda m, i, c, n: m.prefill(i, c, n))
        _, cache = f(model, head, model.init_cache(2, 48), jnp.array([29, 17]))
        logits, cache = f(model, chunk, cache, jnp.array([11, 6]))
        return logits, cache, jax.jit(lambda m, t, c: m.decode_step(t, c))(model, chunk[:, 0], cache)[0]

    whole = run()
    monkeypatch.setattr(mla, "PREFILL_KEY_BLOCK", 16)  # 48 keys: 3 blocks of 2 pages (page size 8)
    blocked = run()
    assert rel_err(blocked[0][0, :11], whole[0][0, :11]) < 1e-5 and rel_err(blocked[0][1, :6], whole[0][1, :6]) < 1e-5
    assert rel_err(blocked[2], whole[2]) < 1e-5
    for a, b in zip(jax.tree.leaves(blocked[1]), jax.tree.leaves(whole[1]), strict=True):
        assert rel_err(np.asarray(a, np.float32), np.asarray(b, np.float32)) < 1e-5


def test_prefill_chunk_temporaries_do_not_grow_with_the_cached_length(monkeypatch):
    """The compiled temporaries of one prefill chunk against a 1K-token and a 4K-token cache: with key blocks
    they are the same size; expanding the whole cache at once, they grow with it."""
    from hybrid_jax.layers import mla

    model = HybridLM(_dense_cfg(), rngs=nnx.Rngs(0))
    chunk = jax.ShapeDtypeStruct((1, 32), jnp.int32)

    def temp_bytes(max_len):
        cache = jax.eval_shape(lambda: model.init_cache(1, max_len))
        lowered = jax.jit(lambda m, i, c: m.prefill(i, c, last_only=True)).lower(model, chunk, cache)
        return lowered.compile().memory_analysis().temp_size_in_bytes

    grows = temp_bytes(4096) - temp_bytes(1024)
    monkeypatch.setattr(mla, "PREFILL_KEY_BLOCK", 256)
    flat = temp_bytes(4096) - temp_bytes(1024)
    assert grows > 3072 * 4 * 4  # at least the expanded keys and values of 3K more positions, float32
    assert flat <= 4096, (flat, grows)  # the page table's few ints at most
