"""The Pallas flash-attention kernel (interpret mode on CPU) against the float32 jnp reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.attention import attention
from tests.conftest import examples, rel_err


def _case(seed, b, t, s, n, nk, h, hv, offsets, lengths, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (b, t, n, h)).astype(dtype)
    k = jax.random.normal(ks[1], (b, s, nk, h)).astype(dtype)
    v = jax.random.normal(ks[2], (b, s, nk, hv)).astype(dtype)
    pos = jnp.asarray(offsets, jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    return q, k, v, pos, jnp.asarray(lengths, jnp.int32)


@settings(max_examples=examples(4), deadline=None)
@given(
    seed=st.integers(0, 2**16),
    b=st.integers(1, 2),
    t=st.integers(1, 40),
    extra=st.integers(0, 50),
    heads=st.sampled_from([(2, 2), (4, 2), (3, 1)]),
    dims=st.sampled_from([(16, 16), (24, 16), (48, 40)]),
    block_q=st.sampled_from([16, 32]),
)
def test_flash_attention_matches_reference(seed, b, t, extra, heads, dims, block_q):
    """Chunked prefill after `extra` cached tokens (positions offset, keys beyond the prompt), grouped heads,
    head dims that are not powers of two, rows and keys not multiples of the blocks."""
    n, nk = heads
    h, hv = dims
    s = t + extra + 3
    offsets = [extra, max(0, extra - 7)][:b]
    lengths = [o + t for o in offsets]  # the second row's cache ends earlier: keys past it are invisible
    q, k, v, pos, kvl = _case(seed, b, t, s, n, nk, h, hv, offsets, lengths)
    kw = dict(q_positions=pos, kv_lengths=kvl, scale=h**-0.5)
    ref_o, ref_lse = attention(q, k, v, impl="reference", **kw)
    o, lse = attention(q, k, v, impl="pallas", block_q=block_q, block_k=16, precision="ieee", interpret=True, **kw)
    assert np.isfinite(np.asarray(lse)).all()  # every query sees its own position: every row was written
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-5, atol=1e-5)
    assert rel_err(o, ref_o) < 1e-5


@pytest.mark.parametrize("block_q", [32, None])
def test_flash_attention_mla_dims_unmasked_blocks_and_padded_rows(block_q):
    """The MLA prefill widths (q/k 192 read as 128 + 64, v 128), a prompt after 37 cached tokens: most key
    blocks go through the unmasked loop, and the last query block's padded rows (70 rows -> 96 or 128)
    take part in it without leaking into real rows or reading as real."""
    from pallas_kernels.attention.kernel import head_pieces

    assert head_pieces(192) == ((0, 128), (128, 64)) and head_pieces(40) == ((0, 32), (32, 16))
    q, k, v, pos, kvl = _case(7, 1, 70, 120, 2, 2, 192, 128, [37], [107], dtype=jnp.bfloat16)
    kw = dict(q_positions=pos, kv_lengths=kvl, scale=192**-0.5)
    ref_o, ref_lse = attention(q, k, v, impl="reference", **kw)
    o, lse = attention(q, k, v, impl="pallas", block_q=block_q, block_k=16, interpret=True, **kw)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=2e-3, atol=2e-3)
    assert rel_err(o, ref_o) < 2e-2


def test_flash_attention_rows_that_see_nothing_and_bf16():
    q, k, v, pos, kvl = _case(3, 2, 20, 40, 4, 4, 32, 32, [0, 10], [20, 30])
    pos = pos.at[1, :5].set(-1)  # padding queries: nothing visible
    kvl = kvl.at[0].set(0)  # an empty cache row
    kw = dict(q_positions=pos, kv_lengths=kvl, scale=0.2)
    ref_o, ref_lse = attention(q, k, v, impl="reference", **kw)
    o, lse = attention(q, k, v, impl="pallas", block_q=16, block_k=16, precision="ieee", interpret=True, **kw)
    empty = np.isneginf(np.asarray(ref_lse))
    assert empty[0].all() and empty[1, :5].all() and not empty[1, 5:].any()
    assert (np.asarray(lse)[empty] == -np.inf).all() and (np.asarray(o)[empty] == 0).all()
    np.testing.assert_allclose(np.asarray(lse)[~empty], np.asarray(ref_lse)[~empty], rtol=1e-5, atol=1e-5)
    assert rel_err(o, ref_o) < 1e-5
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    ob, _ = attention(qb, kb, vb, impl="pallas", block_q=16, block_k=16, interpret=True, **kw)
    assert ob.dtype == jnp.bfloat16 and rel_err(ob, ref_o) < 2e-2  # bf16 products and probabilities


def test_flash_attention_rejects_bad_arguments():
    q, k, v, pos, kvl = _case(0, 1, 4, 8, 2, 2, 16, 16, [4], [8])
    kw = dict(q_positions=pos, kv_lengths=kvl, scale=0.1)
    with pytest.raises(ValueError, match="unknown impl"):
        attention(q, k, v, impl="flash", **kw)
    with pytest.raises(ValueError, match="block_q=48"):
        attention(q, k, v, impl="pallas", block_q=48, interpret=True, **kw)
    wide = jnp.zeros((1, 4, 2, 576))
    with pytest.raises(ValueError, match="pad past 256"):
        attention(wide, jnp.zeros((1, 8, 2, 576)), v, impl="pallas", interpret=True, **kw)


def test_default_tiles_follow_rows_and_shared_memory():
    from pallas_kernels.attention import api

    assert api.shared_bytes(64, 128, 3, 192, 128, 2) == 270336  # what Triton asked for on the H200, refused
    kimi = api.default_tiles(jnp.bfloat16, 192, 128)
    assert kimi == dict(block_q=128, block_k=64, num_warps=8, num_stages=3)  # the measured best
    wide = api.default_tiles(jnp.bfloat16, 256, 256)  # 3 stages would need 256 KiB: one stage less
    assert wide == dict(block_q=128, block_k=64, num_warps=8, num_stages=2)
    pinned = api.default_tiles(jnp.bfloat16, 256, 256, num_stages=3)  # stages given: fewer rows instead
    assert pinned["num_stages"] == 3 and pinned["block_q"] == 64
    for tiles, (h, hv) in ((kimi, (192, 128)), (wide, (256, 256)), (pinned, (256, 256))):
        used = api.shared_bytes(tiles["block_q"], tiles["block_k"], tiles["num_stages"], h, hv, 2)
        assert used <= api.SHARED_MEMORY
    assert api.default_tiles(jnp.bfloat16, 192, 128, rows=8)["block_q"] == 16  # a grouped decode's 8 rows
    assert api.default_tiles(jnp.float32, 64, 64) == dict(block_q=64, block_k=32, num_warps=4, num_stages=2)
