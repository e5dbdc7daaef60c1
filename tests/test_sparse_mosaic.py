"""The Mosaic GPU (sm_90) sparse MLA kernel, `impl="mosaic"`: against the reference on an sm_90 GPU, its
lowering for sm_90 on any machine that has the CUDA plugin's Python files, and its clear refusals everywhere."""

import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax.quant.formats import dequantize_kv_fp8, quantize_kv_fp8
from pallas_kernels import registry
from pallas_kernels.registry import is_sm90, mosaic_sparse_unsupported
from pallas_kernels.sparse_attention import sparse_mla
from pallas_kernels.sparse_attention import tuning as sparse_tuning
from pallas_kernels.sparse_attention.api import dequantizes_pool
from tests.conftest import lower_for_sm90_in_subprocess, rel_err
from tests.test_sparse_kernels import _case

on_sm90 = pytest.mark.skipif(not is_sm90(), reason="needs an sm_90 GPU (run on the H200)")


@on_sm90
@pytest.mark.parametrize(
    "seed, b, t, n, topk, lengths, split_pool, rope",
    [
        # 128 heads (two CTAs a query), top-k not a multiple of 64, short rows (-1 slots), a query with none
        (0, 3, 1, 128, 300, [700, 90, 1], False, 64),
        # 16 heads padded to 64, two query rows each, the rows split into parts merged by LSE, split pools
        (1, 2, 2, 16, 256, [500, 260], True, 64),
        # prefill-like: 40 query rows of one sequence, 128 heads, split pools
        (3, 1, 40, 128, 256, [300], True, 64),
        # decode-sized: 64 queries x 128 heads, top-2048 of 4096, every slot used
        (2, 64, 1, 128, 2048, [4096] * 64, False, 64),
        # NoPE (R = 0, GLM-5.3-Flash): 64 heads, short rows, a query with none; and a prefill-like block
        (4, 3, 1, 64, 320, [900, 70, 1], False, 0),
        (5, 1, 24, 100, 192, [400], False, 0),
    ],
)
def test_mosaic_matches_reference(seed, b, t, n, topk, lengths, split_pool, rope):
    ql, qr, pool, table, idx = _case(seed, b, t, n, 512, rope, 64, topk, lengths, jnp.bfloat16)
    if seed == 2:  # all slots used (the generic case draws how many)
        rng = np.random.default_rng(seed)
        idx = jnp.asarray(np.stack([rng.permutation(4096)[:topk] for _ in range(b)])[:, None].astype(np.int32))
    if lengths[-1] == 1:  # the cases that name "a query with none": its row selects nothing
        idx = idx.at[-1].set(-1)
    ql, qr = ql.astype(jnp.bfloat16), qr.astype(jnp.bfloat16)
    kw = dict(rope_pages=pool[..., 512:]) if split_pool else {}
    pages = pool[..., :512] if split_pool else pool
    ref_o, ref_lse = sparse_mla(ql, qr, pool, table, idx, scale=0.07, impl="reference")
    o, lse = sparse_mla(ql, qr, pages, table, idx, scale=0.07, impl="mosaic", **kw)
    auto_o, _ = sparse_mla(ql, qr, pages, table, idx, scale=0.07, **kw)  # "auto" picks it from 64 heads
    if n >= 64:
        np.testing.assert_array_equal(np.asarray(auto_o), np.asarray(o))
    empty = np.asarray(idx < 0).all(-1)
    assert empty.any() or lengths[-1] != 1  # the cases naming a query with none have one (others may draw one)
    assert (np.asarray(lse)[empty] == -np.inf).all() and (np.asarray(o)[empty] == 0).all()
    np.testing.assert_allclose(np.asarray(lse)[~empty], np.asarray(ref_lse)[~empty], rtol=1e-4, atol=1e-4)
    # bf16 probabilities and output, as the Triton kernel's bf16 products
    assert rel_err(o.astype(jnp.float32), ref_o.astype(jnp.float32)) < 1e-2


@on_sm90
@pytest.mark.parametrize(
    "seed, b, t, n, topk, lengths, rope, page",
    [
        # 128 heads, top-k not a multiple of 64, short rows (-1 slots), a query with none
        (10, 3, 1, 128, 300, [700, 90, 1], 64, 64),
        # 100 heads padded to 128, two query rows each, rows split into parts merged by LSE, pages of 16
        (11, 2, 2, 100, 256, [500, 260], 64, 16),
        # decode-sized: 64 queries x 128 heads, top-2048 of 4096, every slot used
        (12, 64, 1, 128, 2048, [4096] * 64, 64, 64),
        # NoPE (R = 0): 64 heads, a query with none
        (13, 3, 1, 64, 320, [900, 70, 1], 0, 64),
        # prefill-sized: 40 query rows read 20x the pool's rows, so the pool is dequantized once (BF16 kernel)
        (14, 1, 40, 128, 256, [300], 64, 64),
        # 16 heads padded to 64 ("auto" takes FP8 rows to this kernel from 16 heads): 32 query rows, and one
        (15, 32, 1, 16, 256, [900 - 25 * i for i in range(31)] + [1], 64, 64),
        (16, 1, 1, 16, 300, [700], 64, 64),
    ],
)
def test_mosaic_fp8_pool_matches_reference(seed, b, t, n, topk, lengths, rope, page):
    """The FP8 latent pool through the Mosaic GPU kernel (E4M3 rows converted by its producer warpgroup)
    against the reference on the same quantized pool, and bit for bit against the BF16 Mosaic kernel on the
    pool dequantized to bf16 (the conversion is exact, the consumers the same). The pool's rows get
    magnitudes from 1e-3 to 1e2 so the per-128-column scales differ by row and block."""
    ql, qr, pool, table, idx = _case(seed, b, t, n, 512, rope, page, topk, lengths, jnp.float32)
    if seed == 12:
        rng = np.random.default_rng(seed)
        idx = jnp.asarray(np.stack([rng.permutation(4096)[:topk] for _ in range(b)])[:, None].astype(np.int32))
    if lengths[-1] == 1:
        idx = idx.at[-1].set(-1)
    mags = 10.0 ** np.random.default_rng(seed).uniform(-3, 2, pool.shape[:2] + (4, 1))
    lat = (pool[..., :512].reshape(*pool.shape[:2], 4, 128) * mags).reshape(*pool.shape[:2], 512)
    values, scales = quantize_kv_fp8(lat, 128)
    rope_pages = pool[..., 512:].astype(jnp.bfloat16)
    ql, qr = (0.05 * ql).astype(jnp.bfloat16), qr.astype(jnp.bfloat16)
    kw = dict(latent_scales=scales, rope_pages=rope_pages, scale=0.07)
    ref_o, ref_lse = sparse_mla(ql, qr, values, table, idx, impl="reference", **kw)
    o, lse = sparse_mla(ql, qr, values, table, idx, impl="mosaic", **kw)
    auto_o, _ = sparse_mla(ql, qr, values, table, idx, **kw)  # "auto" picks it for each of these cases
    np.testing.assert_array_equal(np.asarray(auto_o), np.asarray(o))
    assert dequantizes_pool(b * t, topk, pool.shape[0] * pool.shape[1]) == (seed == 14)
    bf16_pool = dequantize_kv_fp8(values, scales, jnp.bfloat16)
    o16, lse16 = sparse_mla(ql, qr, bf16_pool, table, idx, impl="mosaic", rope_pages=rope_pages, scale=0.07)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o16))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse16))
    empty = np.asarray(idx < 0).all(-1)
    assert (np.asarray(lse)[empty] == -np.inf).all() and (np.asarray(o)[empty] == 0).all()
    np.testing.assert_allclose(np.asarray(lse)[~empty], np.asarray(ref_lse)[~empty], rtol=1e-4, atol=1e-4)
    assert rel_err(o.astype(jnp.float32), ref_o.astype(jnp.float32)) < 1e-2


def test_mosaic_refusals_name_the_reason():
    ql, qr, pool, table, idx = _case(3, 1, 1, 64, 512, 64, 64, 64, [100], jnp.bfloat16)
    ql, qr = ql.astype(jnp.bfloat16), qr.astype(jnp.bfloat16)
    if not is_sm90():
        with pytest.raises(ValueError, match="needs a Hopper"):
            sparse_mla(ql, qr, pool, table, idx, scale=0.1, impl="mosaic")
    with pytest.raises(ValueError, match="rope 32"):
        sparse_mla(ql, qr[..., :32], pool[..., :544], table, idx, scale=0.1, impl="mosaic")
    with pytest.raises(ValueError, match="float32 queries"):
        sparse_mla(ql.astype(jnp.float32), qr, pool, table, idx, scale=0.1, impl="mosaic")
    values, scales = quantize_kv_fp8(pool[..., :512].astype(jnp.float32), 64)  # a scale every 64 columns
    with pytest.raises(ValueError, match="scale every 64 columns"):
        sparse_mla(
            ql, qr, values, table, idx, scale=0.1, impl="mosaic", latent_scales=scales, rope_pages=pool[..., 512:]
        )
    facts = dict(latent=512, rope=64, q_dtype=jnp.bfloat16, pool_dtype=jnp.bfloat16, fp8=False, precision="bf16")
    assert mosaic_sparse_unsupported(**facts) is None
    fp8_facts = {**facts, "fp8": True, "pool_dtype": jnp.float8_e4m3fn, "fp8_tile": 128}
    assert mosaic_sparse_unsupported(**fp8_facts) is None
    assert "one every 128" in mosaic_sparse_unsupported(**{**fp8_facts, "fp8_tile": 32})
    assert "float32 rope pool" in mosaic_sparse_unsupported(**{**fp8_facts, "rope_dtype": jnp.float32})
    assert mosaic_sparse_unsupported(**{**fp8_facts, "rope_dtype": jnp.bfloat16}) is None
    assert "latent + rope <= 576" in mosaic_sparse_unsupported(**{**facts, "latent": 1024})
    values, scales = quantize_kv_fp8(pool[..., :512].astype(jnp.float32), 128)
    with pytest.raises(ValueError, match="float32 rope pool"):  # the kernel copies the rope rows' bytes
        sparse_mla(ql, qr, values, table, idx, scale=0.1, impl="mosaic", latent_scales=scales,
                   rope_pages=pool[..., 512:].astype(jnp.float32))  # fmt: skip
    with pytest.raises(ValueError, match=r"latent_scales \(.*, 3\) must be"):
        sparse_mla(ql, qr, values, table, idx, scale=0.1, latent_scales=scales[..., :3], rope_pages=pool[..., 512:])
    assert "float32 queries" in mosaic_sparse_unsupported(**{**fp8_facts, "q_dtype": jnp.float32, "precision": "tf32"})
    assert mosaic_sparse_unsupported(**{**facts, "rope": 0}) is None  # NoPE DSA (GLM-5.3-Flash)
    assert "float32 pool" in mosaic_sparse_unsupported(**{**facts, "pool_dtype": jnp.float32})
    # "auto" picks it on an sm_90 GPU from MOSAIC_MIN_HEADS heads (on FP8 rows read at decode from
    # MOSAIC_MIN_HEADS_FP8_ROWS heads), never off one, nor for fewer heads or with tile knobs
    t = sparse_tuning
    fewest, fewest_fp8 = t.MOSAIC_MIN_HEADS, t.MOSAIC_MIN_HEADS_FP8_ROWS
    assert fewest_fp8 < fewest
    for device, heads, tiles, fp8_rows, want in [
        (("gpu", "9.0"), 128, False, False, "mosaic"),
        (("gpu", "9.0"), fewest, False, False, "mosaic"),
        (("gpu", "9.0"), fewest - 1, False, False, "pallas"),
        (("gpu", "9.0"), fewest, False, True, "mosaic"),
        (("gpu", "9.0"), fewest_fp8, False, True, "mosaic"),
        (("gpu", "9.0"), fewest_fp8 - 1, False, True, "pallas"),
        (("gpu", "9.0"), 128, True, True, "pallas"),
        (("gpu", "8.0"), 128, False, True, "pallas"),
        (("cpu", None), 128, False, True, "reference"),
    ]:
        # a BF16 pool and an FP8 pool dequantized whole (prefill) follow the first rule, FP8 rows the second
        for f in ({**fp8_facts, "fp8_rows": True},) if fp8_rows else (facts, fp8_facts):
            with registry.assume_device(*device):
                got = registry.resolve("sparse_mla", heads=heads, tiles_given=tiles, **f)
            assert got.impl == want, (device, heads, tiles, f, got)


def test_auto_reads_fp8_rows_from_the_call():
    """`sparse_mla` tells the rule whether an FP8 latent pool is read row by row (decode) or dequantized whole
    (`dequantizes_pool`: a prefill): 16 heads take the Mosaic GPU kernel on FP8 rows at one query row and at
    many, and the Triton kernel on the pool a prefill dequantizes."""
    import jax

    heads, pool_rows, k = sparse_tuning.MOSAIC_MIN_HEADS_FP8_ROWS, 64 * 40, 64
    prefill_t = -(-sparse_tuning.POOL_DEQUANT_MIN_RATIO * pool_rows // k)
    for b, t, fp8_rows, want in ((1, 1, True, "mosaic"), (32, 1, True, "mosaic"), (1, prefill_t, False, "pallas")):
        assert dequantizes_pool(b * t, k, pool_rows) != fp8_rows
        S = jax.ShapeDtypeStruct
        args = (S((b, t, heads, 512), jnp.bfloat16), S((b, t, heads, 64), jnp.bfloat16),
                S((40, 64, 512), jnp.float8_e4m3fn), S((b, 40), jnp.int32), S((b, t, k), jnp.int32))  # fmt: skip
        kw = dict(latent_scales=S((40, 64, 4), jnp.float32), rope_pages=S((40, 64, 64), jnp.bfloat16))
        with registry.assume_device("gpu", "9.0"), registry.record() as records:
            jax.eval_shape(lambda *a, **kw: sparse_mla(*a, scale=0.1, **kw), *args, **kw)
        [(op, choice, facts)] = records
        assert (facts["fp8_rows"], facts["heads"]) == (fp8_rows, heads), facts
        assert choice.impl == want, (b, t, choice)


_LOWER = """
import sys
sys.path.insert(0, sys.argv[1])
import jax, jax.numpy as jnp
from pallas_kernels.sparse_attention.mosaic_gpu import sparse_mla_mosaic
S = jax.ShapeDtypeStruct
for split, rope in ((False, 64), (True, 64), (False, 0)):
    joint = (S((4096, 512 + rope), jnp.bfloat16),)
    pools = (S((4096, 512), jnp.bfloat16), S((4096, 64), jnp.bfloat16)) if split else joint
    args = (S((3, 128, 512), jnp.bfloat16), S((3, 128, rope), jnp.bfloat16), S((6, 256), jnp.int32), *pools)
    text = sparse_mla_mosaic.trace(*args, scale=0.1, q_splits=2).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text, text[:2000]
# the FP8 latent pool: E4M3 rows, a float32 scale per 128 columns, bf16 rope rows apart (none for NoPE)
for rope in (64, 0):
    rope_rows = S((4096, 64), jnp.bfloat16) if rope else None
    args = (S((3, 128, 512), jnp.bfloat16), S((3, 128, rope), jnp.bfloat16), S((6, 256), jnp.int32),
            S((4096, 512), jnp.float8_e4m3fn), rope_rows, S((4096, 4), jnp.float32))
    text = sparse_mla_mosaic.trace(*args, scale=0.1, q_splits=2).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text, text[:2000]
    for probe in ("nomma", "noconvert"):  # the parts `benchmarks/sparse_mla_bound.py --mosaic` times
        sparse_mla_mosaic.trace(*args, scale=0.1, q_splits=2, probe=probe).lower(lowering_platforms=("cuda",))
# the public wrapper on awkward shapes (100 heads padded to 128, top-300 padded to 320, parts merged by LSE),
# as on a Hopper GPU
import pallas_kernels.registry as registry
import pallas_kernels.sparse_attention.api as api
registry.is_sm90 = lambda: True
for split, t, rope in ((False, 1, 64), (True, 3, 64), (False, 2, 0)):
    kw = dict(rope_pages=S((40, 64, 64), jnp.bfloat16)) if split else {}
    f = jax.jit(lambda *a, **kw: api.sparse_mla(*a, scale=0.1, impl="mosaic", **kw))
    args = (S((2, t, 100, 512), jnp.bfloat16), S((2, t, 100, rope), jnp.bfloat16),
            S((40, 64, 512 if split else 512 + rope), jnp.bfloat16), S((2, 20), jnp.int32), S((2, t, 300), jnp.int32))
    traced = f.trace(*args, **kw)
    assert [o.shape for o in traced.out_info] == [(2, t, 100, 512), (2, t, 100)], traced.out_info
    assert "mosaic_gpu" in traced.lower(lowering_platforms=("cuda",)).as_text()
    # the FP8 latent pool through the wrapper: decode (E4M3 rows) and a prefill-sized call (pool dequantized)
    fp8 = dict(latent_scales=S((40, 64, 4), jnp.float32), rope_pages=S((40, 64, rope), jnp.bfloat16))
    args = (*args[:2], S((40, 64, 512), jnp.float8_e4m3fn), *args[3:])
    assert "mosaic_gpu" in f.trace(*args, **fp8).lower(lowering_platforms=("cuda",)).as_text()
print("lowered")
"""


def test_mosaic_kernel_lowers_for_sm90():
    """Python-side lowering of the Mosaic GPU kernel (layouts, shared memory budget, inline cp.async) for an
    sm_90 target, on a machine without a GPU: needs the jax-cuda13-plugin wheel's files, unpacked, at
    $HYBRID_JAX_CUDA_PLUGIN_DIR (`pip download --no-deps jax-cuda13-plugin==<jax version>` and unzip)."""
    lower_for_sm90_in_subprocess(_LOWER)
