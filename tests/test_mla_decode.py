"""Dense MLA decode over the paged pools: the Pallas kernel (interpret mode on CPU) against the float32 jnp
reference, its lowering for the H200, and its arguments."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_jax.quant.formats import quantize_kv_fp8
from pallas_kernels.mla_decode import mla_decode
from pallas_kernels.mla_decode.api import default_splits
from tests.conftest import examples, rel_err


def _case(seed, b, t, n, lat, rope, page, lengths, spare_pages=3):
    """Scattered pages (a permuted pool with spare pages no sequence owns), every row of the pool random, so a
    kernel that reads a slot past a sequence's length or a page it does not own gets a different answer. The
    queries of row i sit at the last t positions of its lengths[i] tokens (a verify block; t = 1: decode)."""
    ks = jax.random.split(jax.random.key(seed), 5)
    per_seq = -(-max(max(lengths), 1) // page) + 1  # one page more than the longest row needs
    num_pages = b * per_seq + spare_pages
    table = jax.random.permutation(ks[0], num_pages)[: b * per_seq].reshape(b, per_seq).astype(jnp.int32)
    pool = jax.random.normal(ks[1], (num_pages, page, lat + rope))
    ql = jax.random.normal(ks[2], (b, t, n, lat))
    qr = jax.random.normal(ks[3], (b, t, n, rope))
    lens = jnp.asarray(lengths, jnp.int32)
    qpos = lens[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None, :]
    return ql, qr, pool, table, qpos, lens


def _check(got, want, tol):
    (o, lse), (ref_o, ref_lse) = got, want
    empty = np.isneginf(np.asarray(ref_lse))  # queries that see nothing: output 0, LSE -inf
    assert (np.asarray(lse)[empty] == -np.inf).all() and (np.asarray(o)[empty] == 0).all()
    np.testing.assert_allclose(np.asarray(lse)[~empty], np.asarray(ref_lse)[~empty], rtol=tol, atol=tol)
    assert rel_err(o, ref_o) < tol


@settings(max_examples=examples(4), deadline=None)
@given(
    seed=st.integers(0, 2**16),
    b=st.integers(1, 3),
    t=st.integers(1, 3),
    n=st.sampled_from([1, 5, 16, 20]),
    page=st.sampled_from([4, 8, 16]),
    lengths=st.lists(st.integers(0, 75), min_size=3, max_size=3),
    splits=st.sampled_from([None, 1, 3, 7]),
    one_pool=st.booleans(),
)
def test_mla_decode_kernel_matches_reference(seed, b, t, n, page, lengths, splits, one_pool):
    """Lengths not multiples of the page, the block or the split (0: a sequence with nothing cached; shorter
    than t: some queries see nothing), splits past the context's blocks, the latent and rope pools apart or
    as one."""
    ql, qr, pool, table, qpos, lens = _case(seed, b, t, n, 32, 16, page, lengths[:b])
    pools = dict(kv_pages=pool) if one_pool else dict(kv_pages=pool[..., :32], rope_pages=pool[..., 32:])
    kw = dict(q_positions=qpos, kv_lengths=lens, scale=0.2, **pools)
    want = mla_decode(ql, qr, page_table=table, impl="reference", **kw)
    got = mla_decode(
        ql, qr, page_table=table, impl="pallas", precision="ieee", interpret=True, block_k=16, splits=splits, **kw
    )
    _check(got, want, 1e-5)


def test_mla_decode_reference_is_attention_over_the_gathered_context():
    """The reference against a direct evaluation: the context gathered by position, softmax over what each
    query sees."""
    ql, qr, pool, table, qpos, lens = _case(11, 2, 2, 3, 16, 16, 4, [9, 2])
    o, lse = mla_decode(ql, qr, pool, table, q_positions=qpos, kv_lengths=lens, scale=0.3, impl="reference")
    flat = pool.reshape(-1, 32)
    for i in range(2):
        for j in range(2):
            p = int(qpos[i, j])
            if p < 0:
                assert np.isneginf(np.asarray(lse[i, j])).all()
                continue
            rows = flat[table[i, np.arange(p + 1) // 4] * 4 + np.arange(p + 1) % 4]  # [p+1, 32]
            logits = 0.3 * (ql[i, j] @ rows[:, :16].T + qr[i, j] @ rows[:, 16:].T)  # [n, p+1]
            np.testing.assert_allclose(lse[i, j], jax.nn.logsumexp(logits, axis=-1), rtol=1e-5)
            np.testing.assert_allclose(o[i, j], jax.nn.softmax(logits) @ rows[:, :16], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rope", [16, 0])
def test_mla_decode_kernel_fp8_pool(rope):
    """An E4M3 latent pool with per-tile scales, read by the kernel tile by tile, against the reference on
    the same pool; rope 0: no rope query or pool."""
    ql, qr, pool, table, qpos, lens = _case(5, 2, 2, 20, 64, rope, 8, [37, 10])
    values, scales = quantize_kv_fp8(pool[..., :64], 16)
    kw = dict(q_positions=qpos, kv_lengths=lens, scale=0.2, latent_scales=scales)
    kw["rope_pages"] = pool[..., 64:] if rope else None
    want = mla_decode(ql, qr, values, table, impl="reference", **kw)
    got = mla_decode(ql, qr, values, table, impl="pallas", precision="ieee", interpret=True, splits=3, **kw)
    _check(got, want, 1e-5)
    # the scales are used: the same values read as if unscaled give another answer
    other = mla_decode(ql, qr, values, table, impl="reference", **{**kw, "latent_scales": jnp.ones_like(scales)})
    assert rel_err(other[0], want[0]) > 1e-2


def test_mla_decode_kernel_bf16():
    """bfloat16 queries and pools with bfloat16 products (the GPU default): within bfloat16 rounding of the
    float32 reference on the same inputs."""
    ql, qr, pool, table, qpos, lens = _case(8, 2, 1, 32, 64, 16, 8, [70, 23])
    bf = lambda x: x.astype(jnp.bfloat16)  # noqa: E731
    kw = dict(q_positions=qpos, kv_lengths=lens, scale=0.1, rope_pages=bf(pool[..., 64:]))
    ref_o, ref_lse = mla_decode(bf(ql), bf(qr), bf(pool[..., :64]), table, impl="reference", **kw)
    o, lse = mla_decode(bf(ql), bf(qr), bf(pool[..., :64]), table, impl="pallas", interpret=True, **kw)
    assert o.dtype == jnp.bfloat16
    assert rel_err(o.astype(jnp.float32), ref_o.astype(jnp.float32)) < 2e-2
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-2, atol=1e-2)


def test_default_splits_fill_the_gpu_and_stop_at_the_span():
    from pallas_kernels.mla_decode.tuning import MAX_SPLITS, TARGET_PROGRAMS

    assert default_splits(1, 10**6) == min(TARGET_PROGRAMS, MAX_SPLITS)  # one sequence, one head block
    for programs in (3, 16, 50):  # the grid stays within TARGET_PROGRAMS, and one split more would pass it
        sp = default_splits(programs, 10**6)
        assert programs * sp <= TARGET_PROGRAMS < programs * (sp + 1)
    assert default_splits(10 * TARGET_PROGRAMS, 10**6) == 1  # a grid full without splitting
    assert default_splits(1, 5) == 5  # never more splits than blocks the cache can hold


def test_mla_decode_arguments():
    ql, qr, pool, table, qpos, lens = _case(1, 1, 1, 4, 32, 16, 8, [5])
    kw = dict(q_positions=qpos, kv_lengths=lens, scale=0.1)
    with pytest.raises(ValueError, match="unknown impl='triton'"):
        mla_decode(ql, qr, pool, table, impl="triton", **kw)
    with pytest.raises(ValueError, match="pool width 32 does not match latent 32 \\+ rope 16"):
        mla_decode(ql, qr, pool[..., :32], table, **kw)
    with pytest.raises(ValueError, match="block_k=24"):
        mla_decode(ql, qr, pool, table, impl="pallas", block_k=24, **kw)
    with pytest.raises(ValueError, match="splits=0"):
        mla_decode(ql, qr, pool, table, impl="pallas", splits=0, **kw)
    with pytest.raises(ValueError, match="precision='fp16'"):
        mla_decode(ql, qr, pool, table, precision="fp16", **kw)
    with pytest.raises(ValueError, match="latent 24 / rope 16"):
        mla_decode(ql[..., :24], qr, pool[..., 8:], table, impl="pallas", **kw)
    with pytest.raises(ValueError, match="q_positions"):
        mla_decode(ql, qr, pool, table, q_positions=qpos[:, :0], kv_lengths=lens, scale=0.1)


@pytest.mark.parametrize("fp8", [False, True])
def test_mla_decode_kernel_lowers(fp8):
    """The Triton lowering for the H200 at Kimi-Linear's widths (32 heads, latent 512, rope 64, pages of 64)."""
    pytest.importorskip("jax._src.mesh")
    from tests.test_gpu_lowering import _lowered_for_h200

    b, t, n, lat, rope, page, pages = 2, 1, 32, 512, 64, 64, 8
    ql = jnp.ones((b, t, n, lat), jnp.bfloat16)
    qr = jnp.ones((b, t, n, rope), jnp.bfloat16)
    rope_pages = jnp.ones((b * pages, page, rope), jnp.bfloat16)
    if fp8:
        latent, scales = quantize_kv_fp8(jnp.ones((b * pages, page, lat)), 128)
    else:
        latent, scales = jnp.ones((b * pages, page, lat), jnp.bfloat16), None
    table = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)

    def run(ql, qr, latent, rope_pages, table, lens):
        return mla_decode(
            ql, qr, latent, table, q_positions=lens[:, None] - 1, kv_lengths=lens, scale=0.1, rope_pages=rope_pages,
            latent_scales=scales, impl="pallas", interpret=False,
        )  # fmt: skip

    text = _lowered_for_h200(run, ql, qr, latent, rope_pages, table, jnp.full((b,), 300, jnp.int32))
    assert text.count("xla.gpu.triton") == 1 and ("mla_decode_fp8" in text) == fp8
