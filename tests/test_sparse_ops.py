"""Indexer Top-K, sparse MLA and dense attention references, on scattered pages."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import attention
from pallas_kernels.indexer import indexer_topk
from pallas_kernels.paged import contiguous_as_pages, gather_pages, write_rows
from pallas_kernels.sparse_attention import sparse_mla
from tests.conftest import rel_err


def _scattered_pool(seed, contiguous, page_size):
    """Place contiguous [B, S, D] rows into a shuffled pool with spare pages; return (pool, table)."""
    b, s, d = contiguous.shape
    n = s // page_size
    rng = np.random.default_rng(seed)
    pool_pages = b * n + 3
    perm = rng.permutation(pool_pages)[: b * n].reshape(b, n)
    pool = jnp.asarray(rng.normal(size=(pool_pages, page_size, d)), contiguous.dtype)  # garbage elsewhere
    table = jnp.asarray(perm, jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    pool = write_rows(pool, table, pos, jnp.ones((b, s), bool), contiguous)
    return pool, table


def test_paged_roundtrip():
    x = jax.random.normal(jax.random.key(0), (3, 16, 5))
    pool, table = _scattered_pool(0, x, 4)
    np.testing.assert_array_equal(gather_pages(pool, table), x)


def _brute_force_topk(q, w, keys, q_pos, kv_len, topk, scale):
    q, w, keys = (np.asarray(a, np.float64) for a in (q, w, keys))
    s = np.einsum("btnh,bsh->btns", q, keys) * scale
    scores = np.einsum("btns,btn->bts", np.maximum(s, 0), w)
    b, t, n_keys = scores.shape
    out = np.full((b, t, topk), -1)
    for bi in range(b):
        for ti in range(t):
            cand = [j for j in range(n_keys) if j <= q_pos[bi, ti] and j < kv_len[bi]]
            order = sorted(cand, key=lambda j: (-scores[bi, ti, j], j))  # best first, ties to lower position
            out[bi, ti, : min(topk, len(order))] = order[:topk]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("topk", [1, 5, 40])
def test_indexer_topk_matches_brute_force(topk):
    b, t, n, h, s, g = 2, 7, 3, 8, 24, 4
    ks = jax.random.split(jax.random.key(topk), 3)
    q = jax.random.normal(ks[0], (b, t, n, h))
    w = jax.random.normal(ks[1], (b, t, n))
    keys = jax.random.normal(ks[2], (b, s, h))
    pool, table = _scattered_pool(1, keys, g)
    kv_len = jnp.array([24, 13])
    q_pos = jnp.array([[0, 1, 2, 3, 10, 17, 23], [0, 3, 5, 8, 9, 11, 12]])
    idx, scores = indexer_topk(q, w, pool, table, q_positions=q_pos, kv_lengths=kv_len, topk=topk, scale=h**-0.5)
    expect = _brute_force_topk(q, w, keys, np.asarray(q_pos), np.asarray(kv_len), topk, h**-0.5)
    np.testing.assert_array_equal(np.asarray(idx), expect)
    assert (np.asarray(idx)[:, 0, 1:] == -1).all(), "position 0 has exactly one candidate"
    assert np.isneginf(np.asarray(scores)[np.asarray(idx) < 0]).all()


def test_indexer_ties_go_to_lower_position():
    # All-negative q.k: every ReLU is 0, so all candidates tie at score 0.
    keys = jnp.ones((1, 8, 4))
    q = -jnp.ones((1, 1, 2, 4))
    pages, table = contiguous_as_pages(keys)
    idx, _ = indexer_topk(
        q, jnp.ones((1, 1, 2)), pages, table, q_positions=jnp.array([[6]]), kv_lengths=jnp.array([8]), topk=3, scale=1.0
    )
    np.testing.assert_array_equal(np.asarray(idx), [[[0, 1, 2]]])


@pytest.mark.slow
def test_sparse_mla_with_all_positions_equals_dense_absorbed_attention():
    b, t, n, lat, r, s, g = 2, 5, 4, 16, 8, 12, 4
    ks = jax.random.split(jax.random.key(3), 3)
    q_lat = jax.random.normal(ks[0], (b, t, n, lat))
    q_pe = jax.random.normal(ks[1], (b, t, n, r))
    ctx = jax.random.normal(ks[2], (b, s, lat + r))
    pool, table = _scattered_pool(2, ctx, g)
    q_pos = jnp.array([[3, 5, 7, 9, 11], [0, 1, 2, 3, 4]])
    # Every causal position selected, in a shuffled order, padded with -1.
    rng = np.random.default_rng(0)
    idx = np.full((b, t, s + 2), -1)
    for bi in range(b):
        for ti in range(t):
            sel = rng.permutation(int(q_pos[bi, ti]) + 1)
            idx[bi, ti, : len(sel)] = sel
    out, lse = sparse_mla(q_lat, q_pe, pool, table, jnp.asarray(idx, jnp.int32), scale=0.3)
    ref, ref_lse = attention(
        jnp.concatenate([q_lat, q_pe], -1),
        ctx[:, :, None, :],
        ctx[:, :, None, :lat],
        q_positions=q_pos,
        kv_lengths=jnp.array([s, s]),
        scale=0.3,
    )
    assert rel_err(out, ref) < 1e-5
    assert rel_err(lse, ref_lse) < 1e-5


def test_sparse_mla_ignores_unselected_rows():
    b, t, n, lat, r, s = 1, 2, 2, 8, 4, 10
    ks = jax.random.split(jax.random.key(4), 4)
    q_lat, q_pe = jax.random.normal(ks[0], (b, t, n, lat)), jax.random.normal(ks[1], (b, t, n, r))
    ctx = jax.random.normal(ks[2], (b, s, lat + r))
    idx = jnp.array([[[1, 4, -1], [0, 9, 2]]], jnp.int32)
    pool, table = contiguous_as_pages(ctx)
    out, _ = sparse_mla(q_lat, q_pe, pool, table, idx, scale=0.5)
    noisy = ctx.at[:, jnp.array([3, 5, 6, 7, 8])].add(jax.random.normal(ks[3], (b, 5, lat + r)))
    out2, _ = sparse_mla(q_lat, q_pe, *contiguous_as_pages(noisy), idx, scale=0.5)
    np.testing.assert_array_equal(out, out2)
    touched = ctx.at[:, 4].add(1.0)
    out3, _ = sparse_mla(q_lat, q_pe, *contiguous_as_pages(touched), idx, scale=0.5)
    assert not np.allclose(out3[:, 0], out[:, 0])


def test_attention_matches_numpy_softmax():
    b, t, n, nk, h, s = 2, 4, 4, 2, 8, 9
    ks = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(ks[0], (b, t, n, h))
    k = jax.random.normal(ks[1], (b, s, nk, h))
    v = jax.random.normal(ks[2], (b, s, nk, 3))
    q_pos = jnp.array([[2, 4, 6, 8], [0, 1, 2, 3]])
    kv_len = jnp.array([9, 3])
    out, _ = attention(q, k, v, q_positions=q_pos, kv_lengths=kv_len, scale=0.7)
    qn, kn, vn = (np.asarray(a, np.float64) for a in (q, k, v))
    ref = np.zeros((b, t, n, 3))
    for bi in range(b):
        for ti in range(t):
            m = min(int(q_pos[bi, ti]) + 1, int(kv_len[bi]))
            for ni in range(n):
                kh = ni // (n // nk)
                lg = kn[bi, :m, kh] @ qn[bi, ti, ni] * 0.7
                p = np.exp(lg - lg.max())
                ref[bi, ti, ni] = (p / p.sum()) @ vn[bi, :m, kh]
    assert rel_err(out, ref) < 1e-5


def test_bad_impl_is_named():
    with pytest.raises(ValueError, match="impl='triton'"):
        attention(
            jnp.ones((1, 1, 1, 2)),
            jnp.ones((1, 1, 1, 2)),
            jnp.ones((1, 1, 1, 2)),
            q_positions=jnp.zeros((1, 1), int),
            kv_lengths=jnp.ones((1,), int),
            scale=1.0,
            impl="triton",
        )


@pytest.fixture
def tiny_blocks(monkeypatch):
    """Force the references to split the queries into many small blocks."""
    import pallas_kernels._blocking as blocking

    monkeypatch.setattr(blocking, "BLOCK_ELEMENTS", 64)


def _sparse_inputs(seed, b=2, t=9, n=3, lat=8, r=4, s=16, k=5):
    ks = jax.random.split(jax.random.key(seed), 4)
    q_lat, q_pe = jax.random.normal(ks[0], (b, t, n, lat)), jax.random.normal(ks[1], (b, t, n, r))
    pool, table = _scattered_pool(seed, jax.random.normal(ks[2], (b, s, lat + r)), 4)
    rng = np.random.default_rng(seed)
    idx = np.full((b, t, k), -1)
    for bi in range(b):
        for ti in range(t):
            m = rng.integers(0, k + 1)  # some queries select nothing
            idx[bi, ti, :m] = rng.choice(s, size=m, replace=False)
    return q_lat, q_pe, pool, table, jnp.asarray(idx, jnp.int32)


@pytest.mark.slow
def test_sparse_mla_gather_and_mask_forms_agree():
    from pallas_kernels.sparse_attention.reference import sparse_mla_reference

    args = _sparse_inputs(6)
    og, lg = sparse_mla_reference(*args, scale=0.4, form="gather")
    om, lm = sparse_mla_reference(*args, scale=0.4, form="mask")
    assert rel_err(om, og) < 1e-6
    # -inf where nothing is selected, in both. The LSE m + log Σ exp(s - m) of logits |s| ~ 1-5 carries a
    # rounding of a few float32 ulps of the logits, not of itself (the two forms sum in different orders): a
    # relative bound alone fails where the LSE is near zero (0.0446 off by 6e-8, one ulp just below 1, in XLA's code
    # for an AMD EPYC host), hence the absolute term.
    np.testing.assert_allclose(lm, lg, rtol=1e-6, atol=1e-6)
    assert np.isneginf(np.asarray(lg)).any() and (np.asarray(og)[np.isneginf(np.asarray(lg))] == 0).all()


@pytest.mark.slow
def test_query_blocking_changes_nothing(tiny_blocks):
    import pallas_kernels._blocking as blocking
    from pallas_kernels.sparse_attention.reference import sparse_mla_reference

    args = _sparse_inputs(7)
    ks = jax.random.split(jax.random.key(8), 3)
    q, k, v = (jax.random.normal(kk, (2, 9, 2, 4)) for kk in ks)
    pos = jnp.broadcast_to(jnp.arange(9), (2, 9))
    lens = jnp.array([9, 5])

    def all_ops():
        return (
            sparse_mla_reference(*args, scale=0.4, form="gather"),
            sparse_mla_reference(*args, scale=0.4, form="mask"),
            attention(q, k, v, q_positions=pos, kv_lengths=lens, scale=0.5),
            indexer_topk(
                q, v[..., 0], *contiguous_as_pages(k[:, :, 0]), q_positions=pos, kv_lengths=lens, topk=4, scale=0.5
            ),
        )

    blocked = all_ops()  # one query per block under the fixture's budget
    blocking.BLOCK_ELEMENTS = 1 << 27
    whole = all_ops()
    for a, b in zip(jax.tree_util.tree_leaves(blocked), jax.tree_util.tree_leaves(whole), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_dividing_block_avoids_padding_when_it_can():
    from pallas_kernels._blocking import dividing_block

    assert dividing_block(32768, 3584, 64) == 2048  # a 32K prefill's indexer: no padded copy of q
    assert dividing_block(64 * 515, 3584, 64) == 3584  # no multiple of 64 in [1792, 3584] divides it: pad
    assert dividing_block(100, 40) == 25 and dividing_block(30, 64) == 64  # one block holds every query
    for t, block, align in [(1000, 300, 8), (4096, 1000, 16), (97, 20, 1)]:
        got = dividing_block(t, block, align)
        assert got <= block and got % align == 0 and (t % got == 0 or got == block)
