"""Pallas sparse MLA and lightning-indexer kernels (interpret mode on CPU) against the float32 jnp references."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_jax.quant.formats import quantize_kv_fp8
from pallas_kernels.indexer import indexer_topk
from pallas_kernels.sparse_attention import sparse_mla
from tests.conftest import examples, rel_err


def _case(seed, b, t, n, lat, rope, page, topk, lengths, pool_dtype):
    """Scattered pages; row i of the batch holds lengths[i] tokens; each query selects up to topk distinct
    positions among them (the rest -1, so top-k may exceed what is available)."""
    ks = jax.random.split(jax.random.key(seed), 6)
    pages_per_seq = -(-max(lengths) // page)
    num_pages = b * pages_per_seq + 3
    table = jax.random.permutation(ks[0], num_pages)[: b * pages_per_seq].reshape(b, pages_per_seq)
    pool = jax.random.normal(ks[1], (num_pages, page, lat + rope)).astype(pool_dtype)
    ql = jax.random.normal(ks[2], (b, t, n, lat))
    qr = jax.random.normal(ks[3], (b, t, n, rope))
    rng = np.random.default_rng(seed)
    idx = np.full((b, t, topk), -1, np.int32)
    for i in range(b):
        for j in range(t):
            chosen = rng.permutation(lengths[i])[: rng.integers(0, topk + 1)]
            idx[i, j, : chosen.size] = chosen
    return ql, qr, pool, table.astype(jnp.int32), jnp.asarray(idx)


@settings(max_examples=examples(5), deadline=None)
@given(
    seed=st.integers(0, 2**16),
    b=st.integers(1, 2),
    t=st.integers(1, 3),
    n=st.sampled_from([1, 5, 16, 20]),
    topk=st.sampled_from([3, 16, 40]),
    page=st.sampled_from([4, 8]),
    short=st.integers(1, 30),
)
def test_sparse_mla_kernel_matches_reference(seed, b, t, n, topk, page, short):
    lengths = [30, short][:b]
    ql, qr, pool, table, idx = _case(seed, b, t, n, 32, 16, page, topk, lengths, jnp.float32)
    ref_o, ref_lse = sparse_mla(ql, qr, pool, table, idx, scale=0.2, impl="reference")
    o, lse = sparse_mla(ql, qr, pool, table, idx, scale=0.2, impl="pallas", precision="ieee", interpret=True)
    empty = np.asarray(idx < 0).all(-1)  # queries that selected nothing: output 0, LSE -inf
    assert (np.asarray(lse)[empty] == -np.inf).all() and (np.asarray(o)[empty] == 0).all()
    assert np.isfinite(np.asarray(lse)[~empty]).all()  # every other element was written
    np.testing.assert_allclose(np.asarray(lse)[~empty], np.asarray(ref_lse)[~empty], rtol=1e-5, atol=1e-5)
    assert rel_err(o, ref_o) < 1e-5


def test_sparse_mla_kernel_bf16_pool():
    ql, qr, pool, table, idx = _case(4, 2, 2, 16, 64, 16, 8, 24, [29, 17], jnp.bfloat16)
    ref_o, _ = sparse_mla(ql, qr, pool.astype(jnp.float32), table, idx, scale=0.1, impl="reference")
    o, _ = sparse_mla(ql, qr, pool, table, idx, scale=0.1, impl="pallas", precision="ieee", interpret=True)
    assert rel_err(o, ref_o) < 1e-5  # the kernel reads the bf16 rows exactly
    # the model's layout: latent and rope pools kept apart (nothing concatenates them)
    split = dict(scale=0.1, rope_pages=pool[..., 64:])
    kernel = dict(impl="pallas", precision="ieee", interpret=True)
    o_split, _ = sparse_mla(ql, qr, pool[..., :64], table, idx, **kernel, **split)
    ref_split, _ = sparse_mla(ql, qr, pool[..., :64], table, idx, impl="reference", **split)
    assert rel_err(o_split, ref_o) < 1e-5 and rel_err(ref_split, ref_o) < 1e-6
    with pytest.raises(ValueError, match="pool width"):
        sparse_mla(ql, qr, pool, table, idx, **split)


@pytest.mark.parametrize("fp8", [False, True])
def test_sparse_mla_kernel_without_a_rope_part(fp8):
    """R = 0 (GLM-5.3-Flash's NoPE DSA): no rope query, no rope pool, nothing padded; BF16 rows and FP8
    latent tiles, one part and split rows, against the reference."""
    ql, qr, pool, table, idx = _case(7, 2, 2, 5, 32, 0, 8, 40, [45, 13], jnp.float32)
    assert qr.shape[-1] == 0 and pool.shape[-1] == 32
    kw = dict(scale=0.2)
    if fp8:
        values, scales = quantize_kv_fp8(pool, 16)
        kw.update(latent_scales=scales)
        ref_o, ref_lse = sparse_mla(ql, qr, values, table, idx, impl="reference", **kw)
    else:
        values = pool
        ref_o, ref_lse = sparse_mla(ql, qr, values, table, idx, impl="reference", **kw)
    empty = np.asarray(idx < 0).all(-1)
    assert not empty.all()
    for splits in (1, 2):
        o, lse = sparse_mla(  # interpret=None: interpret mode on the CPU, the Triton kernel on a GPU
            ql, qr, values, table, idx, impl="pallas", precision="ieee", interpret=None, splits=splits, **kw
        )
        np.testing.assert_allclose(np.asarray(lse)[~empty], np.asarray(ref_lse)[~empty], rtol=1e-5, atol=1e-5)
        assert rel_err(o, ref_o) < 1e-5, splits


def test_sparse_mla_kernel_checks_slot_rows_per_query():
    """slots must hold q_splits rows per query: a mismatch is an error naming both counts."""
    ql, qr, pool, _, _ = _case(9, 2, 3, 32, 64, 16, 8, 24, [29, 5], jnp.float32)
    from pallas_kernels.sparse_attention.kernel import sparse_mla_pallas

    rows = pool[..., :64].reshape(-1, 64)
    knobs = dict(scale=0.1, block_h=16, block_k=8, precision="ieee", interpret=True)
    with pytest.raises(ValueError, match="12 slot rows for 6 queries in q_splits=3"):  # 18 rows expected
        sparse_mla_pallas(ql.reshape(6, 32, 64), qr.reshape(6, 32, 16), jnp.zeros((12, 8), jnp.int32), rows,
                          pool[..., 64:].reshape(-1, 16), q_splits=3, **knobs)  # fmt: skip


def test_sparse_mla_default_head_block():
    """From 32 heads the kernel takes 32-head blocks by default (measured faster), below that 16."""
    ql, qr, pool, table, idx = _case(8, 1, 1, 32, 32, 16, 8, 40, [35], jnp.float32)
    kw = dict(scale=0.1, impl="pallas", precision="ieee", interpret=True)
    o, lse = sparse_mla(ql, qr, pool, table, idx, **kw)
    o32, lse32 = sparse_mla(ql, qr, pool, table, idx, block_h=32, **kw)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o32))
    grid = lambda **k: str(jax.make_jaxpr(lambda *a: sparse_mla(*a, **kw, **k))(ql, qr, pool, table, idx))  # noqa: E731
    # (head blocks, queries): 32 heads make one 32-head block, or two of 16
    assert "grid=(1, 1)" in grid() and "grid=(2, 1)" in grid(block_h=16)
    assert "grid=(1, 2)" in grid(block_h=16, heads_inner=False)


@pytest.mark.slow
@pytest.mark.parametrize("fp8", [False, True])
def test_sparse_mla_grid_orders_agree(fp8):
    """The grid's order only changes which programs run together: head blocks inner or queries inner give
    the same bits, with several queries, head blocks and parts of the selected rows."""
    ql, qr, pool, table, idx = _case(9, 3, 2, 48, 32, 16, 8, 32, [35, 21, 40], jnp.float32)
    kw = dict(scale=0.1, impl="pallas", precision="ieee", interpret=True, block_h=16, block_k=8, splits=2)
    if fp8:
        values, scales = quantize_kv_fp8(pool[..., :32], 16)
        pool, kw = values, dict(kw, latent_scales=scales, rope_pages=pool[..., 32:])
    a = sparse_mla(ql, qr, pool, table, idx, **kw)
    b = sparse_mla(ql, qr, pool, table, idx, heads_inner=False, **kw)
    ref = sparse_mla(ql, qr, pool, table, idx, **{**kw, "impl": "reference"})
    for x, y, r in zip(a, b, ref, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        np.testing.assert_allclose(np.asarray(x), np.asarray(r), rtol=2e-5, atol=2e-5)


def test_sparse_mla_default_tiles_follow_the_measured_rule():
    """The tiles each default picks (measured on the H200): a given block_h picks the rest for its size, and
    the FP8-row kernel keeps its own; explicit knobs win over the defaults."""
    from pallas_kernels.sparse_attention.api import MANY_ROWS, default_tiles

    assert default_tiles(128, 64, False) == (32, 64, 4, 3)  # decode, 128 heads
    assert default_tiles(16, 16, False) == (16, 32, 4, 2)  # decode, 16 heads: few programs
    assert default_tiles(16, 64, False) == (16, 64, 4, 2)  # decode at batch 64, 16 heads
    assert default_tiles(16, MANY_ROWS, False) == (16, 32, 2, 3)  # prefill, 16 heads
    assert default_tiles(128, 4096, False, block_h=16) == (16, 32, 2, 3)
    assert default_tiles(128, 64, False, block_h=64) == (64, 64, 8, 2)
    assert default_tiles(128, 64, True) == (64, 64, 8, 2)  # FP8 rows
    assert default_tiles(32, 64, True) == (32, 64, 4, 2)
    assert default_tiles(16, 4096, True) == (16, 32, 4, 2)
    # float32 operands (float32 queries): 32-row steps, 2 stages; FP8 rows too (their 64-head tile overflowed)
    assert default_tiles(128, 64, True, precision="tf32") == (32, 32, 4, 2)
    assert default_tiles(128, 4096, False, precision="ieee") == (32, 32, 4, 2)
    assert default_tiles(128, 64, False, block_h=64, precision="tf32") == (64, 32, 8, 2)
    assert default_tiles(16, 64, False, precision="tf32") == (16, 32, 4, 2)  # 16 heads at decode: 32 rows too
    assert default_tiles(16, MANY_ROWS, False, precision="tf32") == (16, 32, 2, 3)  # prefill: as for bf16
    ql, qr, pool, table, idx = _case(8, 3, 1, 32, 32, 16, 8, 40, [35, 12, 40], jnp.float32)
    kw = dict(scale=0.1, impl="pallas", precision="ieee", interpret=True)
    jaxpr = lambda **k: str(jax.make_jaxpr(lambda *a: sparse_mla(*a, **kw, **k))(ql, qr, pool, table, idx))  # noqa: E731
    # 32 heads, top-40: the index list padded to one 64-row step by default, to three 16-row steps when asked
    assert "i32[3,64]" in jaxpr() and "i32[3,48]" not in jaxpr()
    assert "i32[3,48]" in jaxpr(block_k=16) and "i32[3,64]" not in jaxpr(block_k=16)
    ref, _ = sparse_mla(ql, qr, pool, table, idx, scale=0.1, impl="reference")
    assert rel_err(sparse_mla(ql, qr, pool, table, idx, **kw)[0], ref) < 1e-5


def test_sparse_mla_kernel_bf16_products():
    ql, qr, pool, table, idx = _case(6, 2, 2, 16, 64, 16, 8, 40, [29, 17], jnp.bfloat16)
    ref_o, ref_lse = sparse_mla(ql, qr, pool.astype(jnp.float32), table, idx, scale=0.1, impl="reference")
    o, lse = sparse_mla(ql, qr, pool, table, idx, scale=0.1, impl="pallas", precision="bf16", interpret=True)
    empty = np.asarray(idx < 0).all(-1)
    assert (np.asarray(lse)[empty] == -np.inf).all() and (np.asarray(o)[empty] == 0).all()
    np.testing.assert_allclose(np.asarray(lse)[~empty], np.asarray(ref_lse)[~empty], rtol=1e-2, atol=2e-2)
    assert rel_err(o, ref_o) < 1e-2  # bf16 queries and probabilities
    # the default precision follows the inputs: bf16 queries -> bf16 products (the same kernel, same output)
    ql, qr = ql.astype(jnp.bfloat16), qr.astype(jnp.bfloat16)
    kw = dict(scale=0.1, impl="pallas", interpret=True)
    default, _ = sparse_mla(ql, qr, pool, table, idx, **kw)
    explicit, _ = sparse_mla(ql, qr, pool, table, idx, precision="bf16", **kw)
    np.testing.assert_array_equal(np.asarray(default, np.float32), np.asarray(explicit, np.float32))
    with pytest.raises(ValueError, match="precision='fp16'"):
        sparse_mla(ql, qr, pool, table, idx, scale=0.1, impl="pallas", precision="fp16")


def test_sparse_mla_kernel_rejects_odd_widths():
    ql, qr, pool, table, idx = _case(0, 1, 1, 4, 24, 16, 8, 4, [8], jnp.float32)
    with pytest.raises(ValueError, match="latent 24"):
        sparse_mla(ql, qr, pool, table, idx, scale=0.1, impl="pallas", interpret=True)


def test_indexer_kernel_bf16_products_and_bad_knobs():
    """bf16 queries and pool: the default products are bf16 (float32 accumulation); the selection agrees with
    the float32 reference up to near-ties and the chosen scores to bf16 rounding."""
    q, w, pool, table, pos, kv = _indexer_case(4, 2, 3, 16, 64, 8, [61, 40])
    q, pool = q.astype(jnp.bfloat16), pool.astype(jnp.bfloat16)
    kw = dict(q_positions=pos, kv_lengths=kv, topk=12, scale=64**-0.5)
    ref_i, ref_v = indexer_topk(q, w, pool, table, impl="reference", **kw)
    got_i, got_v = indexer_topk(q, w, pool, table, impl="pallas", interpret=True, block_s=16, keys_per_program=32, **kw)
    overlap = np.mean([len(set(a) & set(b)) / len(a) for a, b in zip(np.asarray(got_i).reshape(-1, 12).tolist(),
                                                                     np.asarray(ref_i).reshape(-1, 12).tolist(),
                                                                     strict=True)])  # fmt: skip
    assert overlap >= 0.9
    np.testing.assert_allclose(np.asarray(got_v), np.asarray(ref_v), rtol=3e-2, atol=3e-2)
    with pytest.raises(ValueError, match="keys_per_program=24"):
        indexer_topk(q, w, pool, table, impl="pallas", block_s=16, keys_per_program=24, **kw)
    with pytest.raises(ValueError, match="precision='fp8'"):
        indexer_topk(q, w, pool, table, impl="pallas", precision="fp8", **kw)
    with pytest.raises(ValueError, match="select_segments=4 needs select='kernel'"):
        indexer_topk(q, w, pool, table, impl="pallas", select="top_k", select_segments=4, **kw)
    with pytest.raises(ValueError, match="select_segments=3"):
        indexer_topk(q, w, pool, table, impl="pallas", select="kernel", select_segments=3, **kw)
    with pytest.raises(ValueError, match="block_q=24"):
        indexer_topk(q, w, pool, table, impl="pallas", block_q=24, **kw)
    with pytest.raises(ValueError, match="scale=-0.5"):
        indexer_topk(q, w, pool, table, impl="pallas", **{**kw, "scale": -0.5})


def _indexer_case(seed, b, t, n, h, page, lengths):
    ks = jax.random.split(jax.random.key(seed), 4)
    pages_per_seq = -(-max(lengths) // page)
    num_pages = b * pages_per_seq + 2
    table = jax.random.permutation(ks[0], num_pages)[: b * pages_per_seq].reshape(b, pages_per_seq)
    pool = jax.random.normal(ks[1], (num_pages, page, h))
    q = jax.random.normal(ks[2], (b, t, n, h))
    w = jax.random.normal(ks[3], (b, t, n))
    kv = jnp.asarray(lengths, jnp.int32)
    # decode-like positions: the last t tokens of each row (ragged rows)
    pos = jnp.maximum(kv[:, None] - t + jnp.arange(t)[None, :], 0)
    return q, w, pool, table.astype(jnp.int32), pos, kv


@settings(max_examples=examples(4), deadline=None)
@given(
    seed=st.integers(0, 2**16),
    b=st.integers(1, 2),
    t=st.integers(1, 3),
    n=st.sampled_from([4, 16, 20]),
    topk=st.sampled_from([1, 8, 50]),  # 50 > every available position count
    page=st.sampled_from([4, 8]),
    short=st.integers(1, 37),
    select=st.sampled_from(["kernel", "split", "top_k", "radix"]),
    keys_per_program=st.sampled_from([None, 32, 64]),  # one 16-key block, or 2 / 4 of them per program
    block_q=st.sampled_from([0, 16]),  # the one-query kernel, or the tiled one (queries padded to 16)
    segments=st.sampled_from([1, 4]),  # the selection kernel in one pass per row, or per quarter row + merge
)
def test_indexer_kernel_matches_reference(
    seed, b, t, n, topk, page, short, select, keys_per_program, block_q, segments
):  # fmt: skip
    q, w, pool, table, pos, kv = _indexer_case(seed, b, t, n, 32, page, [37, short][:b])
    kw = dict(q_positions=pos, kv_lengths=kv, topk=topk, scale=32**-0.5)
    ref_i, ref_v = indexer_topk(q, w, pool, table, impl="reference", **kw)
    got_i, got_v = indexer_topk(
        q, w, pool, table, impl="pallas", precision="ieee", interpret=True, block_s=16, select=select,
        keys_per_program=keys_per_program, block_q=block_q, select_segments=segments if select == "kernel" else None,
        **kw,
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(ref_i))  # same positions, same order, -1 pads
    with pytest.raises(ValueError, match="select='sort'"):
        indexer_topk(q, w, pool, table, impl="pallas", select="sort", **kw)
    fin = np.isfinite(np.asarray(ref_v))
    assert (np.isfinite(np.asarray(got_v)) == fin).all()
    np.testing.assert_allclose(np.asarray(got_v)[fin], np.asarray(ref_v)[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("pool_format", ["f32", "mxfp8"])
def test_indexer_tiled_prefill_matches_reference(pool_format):
    """A causal prefill (70 queries after a 9-token prefix in one row, 45 from position 0 in the other: ragged
    lengths, query tiles straddling the diagonal, padded queries) through the tiled score kernel and the
    selection kernel, against the reference; every query's Top-K, -1 pads where fewer keys are visible."""
    from hybrid_jax.quant.formats import dequantize_mxfp8, quantize_mxfp8

    t, topk = 70, 24
    q, w, pool, table, _, _ = _indexer_case(7, 2, t, 4, 64, 8, [79, 45])
    kv = jnp.asarray([79, 45], jnp.int32)
    pos = jnp.stack([9 + jnp.arange(t), jnp.minimum(jnp.arange(t), 44)]).astype(jnp.int32)
    scales = None
    if pool_format == "mxfp8":
        pool, scales = quantize_mxfp8(pool * 5.0)
    ref_pool = pool if scales is None else dequantize_mxfp8(pool, scales)
    kw = dict(q_positions=pos, kv_lengths=kv, topk=topk, scale=0.125)
    ref_i, ref_v = indexer_topk(q, w, ref_pool, table, impl="reference", **kw)
    got_i, got_v = indexer_topk(
        q, w, pool, table, impl="pallas", k_scales=scales, precision="ieee", interpret=True, block_s=16, block_q=32,
        **kw,
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(ref_i))
    assert (np.asarray(got_i)[0, :14] == -1).any() and (np.asarray(got_i)[:, -1] >= 0).all()  # pads and full rows
    fin = np.isfinite(np.asarray(ref_v))
    assert (np.isfinite(np.asarray(got_v)) == fin).all()
    np.testing.assert_allclose(np.asarray(got_v)[fin], np.asarray(ref_v)[fin], rtol=1e-5, atol=1e-5)
    # unsorted: the same sets, in ascending position order, pads last
    raw_i, _ = indexer_topk(
        q, w, pool, table, impl="pallas", k_scales=scales, precision="ieee", interpret=True, block_s=16, block_q=32,
        select="kernel", sort=False, **kw,
    )  # fmt: skip
    ref_sets = np.where(np.asarray(ref_i) < 0, np.iinfo(np.int32).max, np.asarray(ref_i))
    want = np.sort(ref_sets, axis=-1)
    np.testing.assert_array_equal(np.asarray(raw_i), np.where(want == np.iinfo(np.int32).max, -1, want))


# 5 examples (the derandomized draw): every digit width, with and without the prefilter and ties, 1 to 4 rows of
# 1 to 3 chunks, k below a chunk, past it and past the row; the prefilter and the tie rules have their own tests
# below (prefiltered / split selection on heavy tails, ties, empty rows)
@settings(max_examples=examples(5), deadline=None)
@given(
    seed=st.integers(0, 2**16),
    rows=st.integers(1, 4),
    chunks=st.integers(1, 3),
    k=st.sampled_from([1, 5, 16, 33, 100]),
    ties=st.booleans(),
    digit_bits=st.sampled_from([1, 2, 4]),
    prefilter=st.booleans(),
)
def test_selection_kernel_matches_top_k(seed, rows, chunks, k, ties, digit_bits, prefilter):
    """The selection kernel against `lax.top_k` on each row's visible prefix: the same set (ties at the K-th
    value to the lowest positions), in ascending position order, the right values, -1 / -inf after."""
    from pallas_kernels.indexer.select_kernel import top_k_rows_pallas

    chunk = 32
    s = chunk * chunks
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, s)).astype(np.float32)
    if ties:  # few distinct values: many ties at the threshold
        x = np.round(x * 2) / 2
    x[rng.random((rows, s)) < 0.2] = -np.inf  # unreadable pages inside the prefix
    limits = rng.integers(0, s + 1, rows).astype(np.int32)
    x[np.arange(s)[None, :] >= limits[:, None]] = -np.inf  # the caller's contract: -inf past the limit
    vals, idx = top_k_rows_pallas(
        jnp.asarray(x), jnp.asarray(limits), k=k, chunk=chunk, digit_bits=digit_bits, interpret=True,
        prefilter=prefilter,
    )  # fmt: skip
    vals, idx = np.asarray(vals), np.asarray(idx)
    for r in range(rows):
        rv, ri = jax.lax.top_k(jnp.asarray(x[r]), min(k, s))
        want = np.sort(np.asarray(ri)[np.isfinite(np.asarray(rv))])
        n = want.size
        np.testing.assert_array_equal(idx[r, :n], want)
        np.testing.assert_array_equal(vals[r, :n], x[r, want])
        assert (idx[r, n:] == -1).all() and np.isneginf(vals[r, n:]).all()


@pytest.mark.slow
def test_prefiltered_selection_equals_full_selection():
    """The prefilter narrows each long row to k..2k candidates at or above a bound it searches for, in
    position order; the selection among them equals the selection over the whole row (ties to the lowest
    positions), on heavy tails and ties too. Rows it cannot narrow (too short, too few finite scores, all
    tied) are marked -1 and selected in full. Every kind of row in one batch (the rows are independent: one
    compile of each kernel serves them all)."""
    from pallas_kernels.indexer.select_kernel import prefilter_rows, top_k_rows_pallas

    r, s, k, chunk = 6, 512, 12, 32
    kinds = {
        "normal": lambda rng: rng.standard_normal((r, s)),
        "ties": lambda rng: np.round(rng.standard_normal((r, s)) * 2) / 2,
        "cauchy": lambda rng: rng.standard_cauchy((r, s)),
        "lognormal": lambda rng: rng.lognormal(0.0, 4.0, (r, s)),
        "mostly_neg_inf": lambda rng: np.where(rng.random((r, s)) < 0.9, -np.inf, rng.standard_normal((r, s))),
        "constant": lambda rng: np.ones((r, s)),
    }
    limits = np.array([512, 40, 31, 300, 129, 0], np.int32)  # 40 > the 32-candidate width > 31
    x = np.concatenate([draw(np.random.default_rng(11)).astype(np.float32) for draw in kinds.values()])
    limits = np.tile(limits, len(kinds))
    x[np.arange(s)[None, :] >= limits[:, None]] = -np.inf
    xs, ls = jnp.asarray(x), jnp.asarray(limits)
    full = top_k_rows_pallas(xs, ls, k=k, chunk=chunk, interpret=True, prefilter=False)
    pre = top_k_rows_pallas(xs, ls, k=k, chunk=chunk, interpret=True, prefilter=True)
    for a, b in zip(full, pre, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    cand, pos, count = (np.asarray(a) for a in prefilter_rows(xs, ls[:, None], k=k, chunk=chunk, interpret=True))
    count = count[:, 0]
    for j, kind in enumerate(kinds):  # kind by kind
        rows = slice(j * r, (j + 1) * r)
        # narrowed: every row with more finite scores than the width, unless all of them are tied
        narrowed = (np.isfinite(x[rows]).sum(axis=1) > 32) & (kind != "constant")
        took = (count[rows] >= k) & (count[rows] <= 32)
        assert took.tolist() == narrowed.tolist() and narrowed.sum() >= (kind != "constant"), kind
        assert (count[rows][~took] == -1).all(), kind
    for i in np.flatnonzero(count >= 0):  # the candidates: scores >= some bound, in position order, then pads
        n = count[i]
        assert (np.diff(pos[i, :n]) > 0).all() and (pos[i, n:] == -1).all() and np.isneginf(cand[i, n:]).all()
        np.testing.assert_array_equal(cand[i, :n], x[i, pos[i, :n]])
        assert np.sum(x[i] >= cand[i, :n].min()) == n


@pytest.mark.slow
def test_segmented_selection_equals_one_pass():
    """Rows cut into segments and merged: the same (positions, values) as one program per row, including
    ties across segment borders and rows shorter than k."""
    from pallas_kernels.indexer.select_kernel import top_k_rows_pallas, top_k_segmented

    rng = np.random.default_rng(3)
    x = np.round(rng.standard_normal((3, 256)) * 2).astype(np.float32) / 2  # many ties
    limits = np.array([256, 150, 20])
    x[np.arange(256)[None, :] >= limits[:, None]] = -np.inf
    one = top_k_rows_pallas(jnp.asarray(x), jnp.asarray(limits), k=24, chunk=32, interpret=True)
    seg = top_k_segmented(jnp.asarray(x), jnp.asarray(limits), k=24, segments=4, chunk=32, interpret=True)
    for a, b in zip(one, seg, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="3 segments"):
        top_k_segmented(jnp.asarray(x), jnp.asarray(limits), k=24, segments=3, chunk=32, interpret=True)


def _tied_kth(rng, r, s):
    """Rows whose K-th value (k = 20) is shared by 60 scores: 10 above it, and many more candidates than the
    best-first ranking takes whole (2k), so it must choose which of the ties to keep."""
    x = rng.standard_normal((r, s))
    for row in x:
        at = rng.permutation(s)
        row[at[:10]] = 5 + rng.random(10)
        row[at[10:70]] = 3.0
    return x


@pytest.mark.slow
def test_split_selection_equals_row_selection():
    """The split selection (each row's statistics, counting and compaction over many programs, then one
    selection among the candidates) returns what one program per row does — same positions in position
    order, same values, ties to the lowest positions, -1 / -inf pads — on heavy tails, ties, rows with
    fewer than k finite scores, empty rows, and a segment count that is not a power of two (6 segments of
    64, each pass two 32-score steps inside a segment with `seg` 64 and the pass step patched to 32).
    Every kind of row in one batch (the rows are independent: one compile of each path serves them all)."""
    from pallas_kernels.indexer import select_split
    from pallas_kernels.indexer.select_kernel import top_k_rows_pallas

    r, s, k = 6, 384, 20
    kinds = {
        "normal": lambda rng: rng.standard_normal((r, s)),
        "ties": lambda rng: np.round(rng.standard_normal((r, s)) * 2) / 2,
        "cauchy": lambda rng: rng.standard_cauchy((r, s)),
        "mostly_neg_inf": lambda rng: np.where(rng.random((r, s)) < 0.95, -np.inf, rng.standard_normal((r, s))),
        "constant": lambda rng: np.ones((r, s)),
        "skewed": lambda rng: rng.exponential(size=(r, s)) ** 3,
        "tied_kth": lambda rng: _tied_kth(rng, r, s),
    }
    limits = np.array([384, 200, 64, 19, 0, 321], np.int32)  # whole, mid-segment, one segment, < k, empty
    x = np.concatenate([draw(np.random.default_rng(5)).astype(np.float32) for draw in kinds.values()])
    limits = np.tile(limits, len(kinds))
    x[np.arange(s)[None, :] >= limits[:, None]] = -np.inf
    xs, ls = jnp.asarray(x), jnp.asarray(limits)

    def check(got, want):  # kind by kind
        for a, b in zip(got, want, strict=True):
            for i, kind in enumerate(kinds):
                np.testing.assert_array_equal(np.asarray(a)[i * r : (i + 1) * r], np.asarray(b)[i * r : (i + 1) * r],
                                              err_msg=kind)  # fmt: skip

    want = top_k_rows_pallas(xs, ls, k=k, chunk=128, interpret=True, prefilter=False)
    steps = dict(pass_chunk=32)  # several steps per program in every pass
    got = select_split.top_k_split(xs, ls, k=k, chunk=128, seg=64, interpret=True, **steps)
    check(got, want)
    # best first: the candidates ranked against each other (rows with more than 2k of them — ties, a
    # constant row, tied_kth — cut to k by each ranking program's own search), in lax.top_k's order
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(select_split, "RANK_STEP", 16)  # several steps per ranking program
        mp.setattr(select_split, "RANK_SEARCH_CHUNK", 32)  # several steps of the search ...
        mp.setattr(select_split, "RANK_GATHER_CHUNK", 16)  # ... and of the scan for the chosen
        vals, idx = select_split.top_k_split.__wrapped__(
            xs, ls, k=k, chunk=128, seg=64, best_first=True, interpret=True, **steps
        )
    top_v, top_i = jax.lax.top_k(xs, k)
    check((vals, idx), (top_v, np.where(np.isneginf(top_v), -1, np.asarray(top_i))))
    # the default segment size (for the 6 rows of one kind), and the shape errors
    got = select_split.top_k_split(xs[:r], ls[:r], k=k, chunk=128, interpret=True)
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(np.asarray(a)[:r], np.asarray(b))
    with pytest.raises(ValueError, match="seg=48"):
        select_split.top_k_split(xs, ls, k=k, chunk=128, seg=48, interpret=True)
    with pytest.raises(ValueError, match="chunk=96"):
        select_split.top_k_split(xs, ls, k=k, chunk=96, interpret=True)
    with pytest.raises(ValueError, match="pass_chunk=24"):
        select_split.top_k_split(xs, ls, k=k, chunk=128, pass_chunk=24, interpret=True)


@pytest.mark.slow
def test_split_selection_from_given_statistics():
    """Statistics from elsewhere (the score kernel's, one entry per program, the rows past `stats_parts`
    garbage) replace the first pass: the same result as the split's own statistics; a mis-shaped stats array
    or a bad part count is an error naming it."""
    from pallas_kernels.indexer.select_split import STATS, top_k_split

    rng = np.random.default_rng(11)
    r, s, k = 2, 256, 12
    x = rng.standard_normal((r, s)).astype(np.float32) ** 3
    limits = np.array([256, 170], np.int32)
    x[np.arange(s)[None, :] >= limits[:, None]] = -np.inf
    stats = np.full((r, 4, STATS), np.nan, np.float32)  # 3 unequal parts, then an unwritten row
    for i, (a, e) in enumerate([(0, 40), (40, 200), (200, 256)]):
        part = x[:, a:e]
        fin = np.isfinite(part)
        z = np.where(fin, part, 0.0)
        stats[:, i, :5] = np.stack(
            [fin.sum(1), z.sum(1), (z * z).sum(1), np.where(fin, part, np.inf).min(1), part.max(1)], axis=1
        )
    xs, ls = jnp.asarray(x), jnp.asarray(limits)
    kw = dict(k=k, chunk=128, seg=64, best_first=True, interpret=True)
    want = top_k_split(xs, ls, **kw)
    got = top_k_split(xs, ls, stats=jnp.asarray(stats), stats_parts=3, **kw)
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match=r"stats.shape=\(2, 3, 8\)"):
        top_k_split(xs, ls, stats=jnp.asarray(stats[:, :3]), stats_parts=3, **kw)
    with pytest.raises(ValueError, match="stats_parts=5"):
        top_k_split(xs, ls, stats=jnp.asarray(stats), stats_parts=5, **kw)


@pytest.mark.slow
def test_indexer_prefill_chunk_runs_the_gpu_default_path():
    """A prefill chunk of 64-511 queries over a long context, as impl="auto" runs it on a GPU (here forced with
    use_pallas, interpreted): the tiled score kernel (64-query tiles) then the split selection (fewer than 512
    rows, at least 8 x top-k keys), fixed values against the reference. The K-th and (K+1)-th reference scores
    are apart (a near tie would make either choice right)."""
    from pallas_kernels import use_pallas
    from pallas_kernels.indexer.api import default_selection
    from pallas_kernels.indexer.tuning import TILED_MIN_QUERIES

    t, topk = 70, 16
    q, w, pool, table, _, _ = _indexer_case(42, 2, t, 4, 64, 8, [230, 170])
    w = jnp.abs(w) + 0.1  # positive head weights: no run of exactly-zero scores at the K-th place
    kv = jnp.asarray([230, 170], jnp.int32)
    pos = jnp.stack([160 + jnp.arange(t), 100 + jnp.arange(t)]).astype(jnp.int32)  # the chunk's last 70 tokens
    keys = table.shape[1] * pool.shape[1]
    assert t >= TILED_MIN_QUERIES and default_selection(2 * t, keys, topk)[0] == "split"
    kw = dict(q_positions=pos, kv_lengths=kv, topk=topk, scale=0.125)
    ref_i, ref_v = indexer_topk(q, w, pool, table, impl="reference", **kw)
    full_v = indexer_topk(q, w, pool, table, impl="reference", **{**kw, "topk": topk + 1})[1]
    gap = np.asarray(full_v)[..., topk - 1] - np.asarray(full_v)[..., topk]
    assert gap.min() > 1e-3, gap.min()
    fn = lambda *a: indexer_topk(*a, precision="ieee", interpret=True, **kw)  # noqa: E731
    with use_pallas(ops=["indexer"]):
        got_i, got_v = fn(q, w, pool, table)
        jaxpr = str(jax.make_jaxpr(fn)(q, w, pool, table))
    assert "indexer_scores_tiled" in jaxpr and "indexer_split_" in jaxpr, "not the tiled scores + split selection"
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(ref_i))
    np.testing.assert_allclose(np.asarray(got_v), np.asarray(ref_v), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_indexer_split_path_matches_reference():
    """The decode path with the split selection: score kernels of 2 blocks each that also write their
    statistics, the selection's counting and compaction from them, the candidates ranked best first — the
    reference's positions and order, ragged lengths, scattered pages, -1 pads past a short row, with and
    without `sort`."""
    q, w, pool, table, pos, kv = _indexer_case(21, 2, 2, 16, 32, 8, [150, 9])
    kw = dict(q_positions=pos, kv_lengths=kv, topk=24, scale=32**-0.5)
    ref_i, ref_v = indexer_topk(q, w, pool, table, impl="reference", **kw)
    for sort in (True, False):
        got_i, got_v = indexer_topk(
            q, w, pool, table, impl="pallas", precision="ieee", interpret=True, block_s=16, keys_per_program=32,
            select="split", sort=sort, **kw,
        )  # fmt: skip
        np.testing.assert_array_equal(np.asarray(got_i), np.asarray(ref_i))
        np.testing.assert_allclose(np.asarray(got_v), np.asarray(ref_v), rtol=1e-5, atol=1e-5)
    assert (np.asarray(ref_i)[1] == -1).any() and (np.asarray(ref_i)[0] >= 0).all()
    # the statistics the score kernel hands over: those of its own scores, per program of 32 keys (3 of 4
    # rows written: 96 slots), -inf (masked) scores left out
    from pallas_kernels.indexer.kernel import indexer_scores_pallas
    from pallas_kernels.paged import slot_index

    slots = slot_index(table, jnp.broadcast_to(jnp.arange(96, dtype=jnp.int32), (2, 96)), 8)
    slots = jnp.where(jnp.arange(96) < 72, slots, -1)  # 9 pages of 8
    kw = dict(scale=0.2, block_s=16, steps=2, precision="ieee", interpret=True, stats=True)
    scores, stats, limits = indexer_scores_pallas(q, w, pos, kv, slots, pool.reshape(-1, 32), None, **kw)
    # the same from the page table (9 pages: positions 72 .. 95 none), the rows found in the kernel
    paged = indexer_scores_pallas(q, w, pos, kv, table[:, :9], pool.reshape(-1, 32), None, page_size=8, keys=96, **kw)
    for a, b in zip((scores, stats[:, :, :3]), (paged[0], paged[1][:, :, :3]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the limits: the visible prefix within what the slots (96) or the 9 pages (72) cover
    seen = np.minimum(np.asarray(pos) + 1, np.asarray(kv)[:, None])
    assert np.asarray(limits)[..., 0].tolist() == np.minimum(seen, 96).tolist()
    assert np.asarray(paged[2])[..., 0].tolist() == np.minimum(seen, 72).tolist() != seen.tolist()
    with pytest.raises(ValueError, match="page_size=8 and keys=None"):
        indexer_scores_pallas(q, w, pos, kv, table, pool.reshape(-1, 32), None, page_size=8, **kw)
    x = np.asarray(scores).reshape(2, 2, 3, 32)
    fin = np.isfinite(x)
    z = np.where(fin, x, 0.0)
    want = np.stack([fin.sum(-1), z.sum(-1), (z * z).sum(-1), np.where(fin, x, np.inf).min(-1), x.max(-1)], -1)
    assert stats.shape == (2, 2, 4, 8) and fin.any() and not fin.all()
    np.testing.assert_allclose(np.asarray(stats)[:, :, :3, :5], want, rtol=1e-5, atol=1e-5)


def test_split_segment_size():
    from pallas_kernels.indexer.select_split import segment_size

    assert segment_size(1, 131072, 4096) == 1024  # one row: about one program per SM
    assert segment_size(16, 131072, 4096) == 4096 and segment_size(64, 32768, 4096) == 4096  # capped at chunk
    assert segment_size(1, 32768, 4096) == 256 and segment_size(1, 512, 128) == 128  # the floor; short rows: chunk


def test_default_selection_rule():
    from pallas_kernels.indexer.api import default_selection

    assert default_selection(32768, 32768, 2048) == ("kernel", 1)  # prefill rows
    assert default_selection(64, 131072, 2048) == ("split", 1)  # decode, long context: passes over many programs
    assert default_selection(1, 131072, 2048) == ("split", 1) and default_selection(16, 16384, 2048) == ("split", 1)
    assert default_selection(64, 8192, 2048) == ("top_k", 1)  # short context
    assert default_selection(1, 2112, 2048) == ("kernel", 1)  # context near topk: top_k would sort the row
    assert default_selection(64, 4096, 2048) == ("kernel", 1) and default_selection(1, 1024, 2048) == ("kernel", 1)
    assert default_selection(511, 131072, 2048) == ("split", 1) and default_selection(512, 131072, 2048)[0] == "kernel"


@pytest.mark.slow
def test_selection_kernel_long_prefix_few_finite():
    """A prefix longer than k holding fewer than k finite scores (unreadable pages): the radix threshold
    lands on -inf, which is never taken; and a row whose k-th value is tied across chunks."""
    from pallas_kernels.indexer.select_kernel import top_k_rows_pallas

    x = np.full((2, 128), -np.inf, np.float32)
    x[0, [3, 40, 77, 90]] = [1.0, -2.0, 0.5, 3.0]
    x[1, :100] = 1.0
    x[1, [5, 70]] = 2.0
    vals, idx = top_k_rows_pallas(jnp.asarray(x), jnp.asarray([100, 100]), k=8, chunk=32, interpret=True)
    np.testing.assert_array_equal(np.asarray(idx[0]), [3, 40, 77, 90, -1, -1, -1, -1])
    np.testing.assert_array_equal(np.asarray(vals[0, :4]), [1.0, -2.0, 0.5, 3.0])
    np.testing.assert_array_equal(np.asarray(idx[1]), [0, 1, 2, 3, 4, 5, 6, 70])  # ties: the lowest positions


def test_indexer_kernel_reads_mxfp8_pool():
    from hybrid_jax.quant.formats import dequantize_mxfp8, quantize_mxfp8

    q, w, pool, table, pos, kv = _indexer_case(1, 2, 2, 16, 64, 8, [29, 40])
    values, scales = quantize_mxfp8(pool * 7.0)
    kw = dict(q_positions=pos, kv_lengths=kv, topk=16, scale=0.125)
    ref_i, ref_v = indexer_topk(q, w, dequantize_mxfp8(values, scales), table, impl="reference", **kw)
    got_i, got_v = indexer_topk(
        q, w, values, table, impl="pallas", k_scales=scales, precision="ieee", interpret=True, **kw
    )
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(ref_i))
    fin = np.isfinite(np.asarray(ref_v))
    np.testing.assert_allclose(np.asarray(got_v)[fin], np.asarray(ref_v)[fin], rtol=1e-5, atol=1e-5)
    # the reference reads the same quantized pool by dequantizing it first
    ref2_i, _ = indexer_topk(q, w, values, table, impl="reference", k_scales=scales, **kw)
    np.testing.assert_array_equal(np.asarray(ref2_i), np.asarray(ref_i))
    with pytest.raises(ValueError, match="k_scales width"):
        indexer_topk(q, w, values, table, impl="reference", k_scales=scales[..., :1], **kw)


@pytest.mark.parametrize("precision", ["bf16", "ieee"])
def test_indexer_kernel_scales_each_mxfp8_block_by_its_own_exponent(precision):
    """Blocks of 32 channels at magnitudes 2^-6 ... 2^5 apart: a scale applied to the wrong block, or one
    block's scale to a whole row, changes the scores by orders of magnitude. bf16 queries, so bf16 products are
    exact and both precisions must pick the reference's positions."""
    from hybrid_jax.quant.formats import dequantize_mxfp8, quantize_mxfp8

    q, w, pool, table, pos, kv = _indexer_case(7, 2, 3, 16, 128, 8, [37, 61])
    magnitude = jnp.repeat(jnp.asarray([2.0**-6, 2.0**5, 1.0, 2.0**-3]), 32)
    values, scales = quantize_mxfp8(pool * magnitude)
    q = q.astype(jnp.bfloat16)
    kw = dict(q_positions=pos, kv_lengths=kv, topk=24, scale=0.125)
    ref = functools.partial(indexer_topk, q.astype(jnp.float32), w, dequantize_mxfp8(values, scales), table,
                            impl="reference", q_positions=pos, kv_lengths=kv, scale=0.125)  # fmt: skip
    ref_i, ref_v = ref(topk=24)
    ref_v = np.asarray(ref_v)
    fin = np.isfinite(ref_v)
    every = np.asarray(ref(topk=64)[1])  # each query's visible scores, best first (-inf after them)
    # the fixture has one right answer, order included: no two of a query's best 25 scores nearly tie
    best = every[..., :25]
    assert np.isfinite(best).all()  # every query sees more than 24 keys
    assert np.all(-np.diff(best, axis=-1) > 1e-4 * np.abs(best).max())
    got_i, got_v = indexer_topk(
        q, w, values, table, impl="pallas", k_scales=scales, precision=precision, interpret=True, block_s=16,
        keys_per_program=32, **kw,
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(ref_i))
    # float32 sums in another order: errors scale with the largest score, not with each score
    np.testing.assert_allclose(np.asarray(got_v)[fin], ref_v[fin], rtol=0, atol=1e-6 * np.abs(ref_v[fin]).max())


def test_sparse_mla_kernel_fp8_latent_pool():
    from hybrid_jax.quant.formats import quantize_kv_fp8

    lat, rope, tile = 64, 16, 32
    ql, qr, pool, table, idx = _case(9, 2, 2, 16, lat, rope, 8, 24, [29, 17], jnp.float32)
    values, scales = quantize_kv_fp8(pool[..., :lat] * 30.0, tile)  # FP8 latents, float32 scale per 32
    rope_pages = pool[..., lat:]
    kw = dict(scale=0.1, latent_scales=scales, rope_pages=rope_pages)
    ref_o, ref_lse = sparse_mla(ql, qr, values, table, idx, impl="reference", **kw)
    o, lse = sparse_mla(ql, qr, values, table, idx, impl="pallas", precision="ieee", interpret=True, **kw)
    assert rel_err(o, ref_o) < 1e-5
    o3, _ = sparse_mla(ql, qr, values, table, idx, impl="pallas", precision="ieee", interpret=True, block_k=8,
                       splits=3, **kw)  # fmt: skip
    assert rel_err(o3, ref_o) < 1e-5
    fin = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(ref_lse)[fin], rtol=1e-5, atol=1e-5)
    # bf16 products on the FP8 rows (E4M3 -> bf16 is exact): bf16 queries and probabilities only
    ob, lseb = sparse_mla(ql.astype(jnp.bfloat16), qr.astype(jnp.bfloat16), values, table, idx, impl="pallas",
                          precision="bf16", interpret=True, **kw)  # fmt: skip
    assert rel_err(ob, ref_o) < 2e-2 and rel_err(ob, o) > 0  # the bf16 path ran, not the float32 one
    np.testing.assert_allclose(np.asarray(lseb)[fin], np.asarray(ref_lse)[fin], rtol=2e-2, atol=2e-2)
    # bf16 queries take bf16 products by default on FP8 rows too
    od, _ = sparse_mla(ql.astype(jnp.bfloat16), qr.astype(jnp.bfloat16), values, table, idx, impl="pallas",
                       interpret=True, **kw)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(od, np.float32), np.asarray(ob, np.float32))
    with pytest.raises(ValueError, match="needs its rope pool"):
        sparse_mla(ql, qr, values, table, idx, scale=0.1, latent_scales=scales)


@pytest.mark.slow
@pytest.mark.parametrize("splits", [2, 3, 6])
def test_sparse_mla_split_rows_merge_to_the_reference(splits):
    """Decode at a small batch: the selected rows run in `splits` parts merged by LSE. Some queries select
    nothing (lse -inf, output 0) and many parts hold only -1 rows (a short sequence)."""
    ql, qr, pool, table, idx = _case(11, 2, 3, 16, 32, 16, 4, 48, [30, 5], jnp.float32)
    idx = idx.at[1, 0].set(-1)  # one query with nothing selected
    kw = dict(scale=0.2, rope_pages=pool[..., 32:])
    ref_o, ref_lse = sparse_mla(ql, qr, pool[..., :32], table, idx, impl="reference", **kw)
    o, lse = sparse_mla(ql, qr, pool[..., :32], table, idx, impl="pallas", precision="ieee", interpret=True,
                        block_k=8, splits=splits, **kw)  # fmt: skip
    empty = np.asarray(idx < 0).all(-1)
    assert (np.asarray(lse)[empty] == -np.inf).all() and (np.asarray(o)[empty] == 0).all()
    np.testing.assert_allclose(np.asarray(lse)[~empty], np.asarray(ref_lse)[~empty], rtol=1e-5, atol=1e-5)
    assert rel_err(o, ref_o) < 1e-5
    with pytest.raises(ValueError, match="splits=4"):
        sparse_mla(ql, qr, pool[..., :32], table, idx, impl="pallas", interpret=True, block_k=8, splits=4, **kw)


def test_sparse_mla_default_splits_only_for_small_grids():
    from pallas_kernels.sparse_attention.api import num_splits

    assert num_splits(programs=1, rows=2048, block_k=32) == 16  # batch 1, 16 heads: 16 parts of 128 rows
    assert num_splits(programs=8, rows=2048, block_k=32) == 16  # batch 1, 128 heads in blocks of 16
    assert num_splits(programs=64, rows=2048, block_k=32) == 2
    assert num_splits(programs=1024, rows=2048, block_k=32) == 1  # batch 64 x 16 head blocks: no split
    assert num_splits(programs=1, rows=64, block_k=32) == 1  # too few rows to split
    assert num_splits(programs=64, rows=2048, block_k=64, target=256) == 4  # batch 64, one 16-head block


@pytest.mark.slow
def test_sparse_mla_fp8_pool_at_prefill_runs_the_bf16_row_kernel_on_the_dequantized_pool(monkeypatch):
    """Many query rows against a small pool (a prefill): the pool is dequantized once and the BF16-row kernel
    reads it — the same values as the reference and, up to summation order, as the FP8-row kernel."""
    from hybrid_jax.quant.formats import quantize_kv_fp8
    from pallas_kernels.sparse_attention import api

    lat, rope, tile = 64, 16, 32
    ql, qr, pool, table, idx = _case(4, 1, 24, 5, lat, rope, 8, 32, [40], jnp.float32)  # 64 pool rows
    assert 1 * 24 * 32 >= api.POOL_DEQUANT_MIN_RATIO * pool.shape[0] * pool.shape[1]
    values, scales = quantize_kv_fp8(pool[..., :lat] * 30.0, tile)
    kw = dict(scale=0.1, latent_scales=scales, rope_pages=pool[..., lat:], impl="pallas", interpret=True)
    ref_o, ref_lse = sparse_mla(ql, qr, values, table, idx, scale=0.1, latent_scales=scales,
                                rope_pages=pool[..., lat:], impl="reference")  # fmt: skip

    def kernels(*args, **kwargs):  # which kernel runs: the jitted wrapper's name in the program
        text = str(jax.make_jaxpr(lambda *a: sparse_mla(*a, **kwargs))(*args))
        return "name=sparse_mla_fp8_pallas" in text, "name=sparse_mla_pallas" in text

    o, lse = sparse_mla(ql, qr, values, table, idx, precision="ieee", **kw)
    assert rel_err(o, ref_o) < 1e-5
    fin = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(ref_lse)[fin], rtol=1e-5, atol=1e-5)
    assert kernels(ql, qr, values, table, idx, precision="ieee", **kw) == (False, True)
    # the dequantized pool: float32 for "ieee" products only; TF32 ones read it in bfloat16 (exact, half the bytes)
    rows = pool.shape[0] * pool.shape[1]
    pool_dtype = lambda p: str(jax.make_jaxpr(lambda *a: sparse_mla(*a, precision=p, **kw))(ql, qr, values, table, idx))  # noqa: E731
    assert f"f32[{rows},{lat}]" in pool_dtype("ieee") and f"bf16[{rows},{lat}]" in pool_dtype("tf32")
    ot, _ = sparse_mla(ql, qr, values, table, idx, **kw)  # float32 queries: TF32 products by default
    assert rel_err(ot, ref_o) < 1e-5  # interpret mode multiplies in float32: the bf16 pool lost nothing
    # bf16 queries: the pool dequantized to bfloat16 (exact), against the FP8-row kernel on the same call
    qlb, qrb = ql.astype(jnp.bfloat16), qr.astype(jnp.bfloat16)
    ob, _ = sparse_mla(qlb, qrb, values, table, idx, **kw)
    monkeypatch.setattr(api, "POOL_DEQUANT_MIN_RATIO", 10**9)
    assert kernels(qlb, qrb, values, table, idx, **kw) == (True, False)  # now the FP8-row kernel
    of, _ = sparse_mla(qlb, qrb, values, table, idx, **kw)
    assert rel_err(ob, ref_o) < 2e-2 and rel_err(ob, of) < 5e-3
