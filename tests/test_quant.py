"""MXFP8 and FP8-KV formats against a small NumPy statement of the specs; the quantized model."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from hybrid_jax import HybridLM
from hybrid_jax.quant.config import IndexerQuant, KVCacheQuant, ProjectionQuant, QuantConfig
from hybrid_jax.quant.formats import dequantize_kv_fp8, dequantize_mxfp8, quantize_kv_fp8, quantize_mxfp8
from tests.conftest import prefill_then_decode, random_ids, rel_err

E4M3 = ml_dtypes.float8_e4m3fn


def mx_numpy(x: np.ndarray):
    """OCP MX v1.0, E4M3, k = 32: e = floor(log2 amax) - 8 clamped to [-127, 127]; P = sat(RNE(x / 2^e))."""
    blocks = x.reshape(-1, 32).astype(np.float64)
    out_v, out_e = [], []
    for b in blocks:
        amax = np.abs(b).max()
        e = -127 if amax == 0 else int(np.clip(np.frexp(amax)[1] - 1 - 8, -127, 127))
        p = np.clip(b / 2.0**e, -448, 448).astype(np.float32).astype(E4M3)
        out_v.append(p)
        out_e.append(e)
    return np.stack(out_v).reshape(x.shape), np.array(out_e).reshape(*x.shape[:-1], x.shape[-1] // 32)


def kv_numpy(x: np.ndarray, tile: int):
    t = x.reshape(-1, tile).astype(np.float64)
    s = 2.0 ** np.ceil(np.log2(np.maximum(np.abs(t).max(-1) / 448, 1e-4)))
    v = np.clip(t / s[:, None], -448, 448).astype(np.float32).astype(E4M3)
    return v.reshape(x.shape), s.reshape(*x.shape[:-1], -1)


def _e8m0_exponent(scales) -> np.ndarray:
    return np.asarray(jax.lax.bitcast_convert_type(scales, jnp.uint8)).astype(int) - 127


def test_mxfp8_matches_the_spec_on_hand_made_and_random_blocks():
    rng = np.random.default_rng(0)
    blocks = [
        np.zeros(32),  # all zeros: smallest scale, zero elements
        np.r_[448.0, rng.uniform(-448, 448, 31)],  # the largest E4M3 value: scale 2^0, 448 kept exactly
        np.full(32, 2.0**-140),  # needs a scale below 2^-127: clamped
        np.r_[1.0, 2.0**-8, 2.0**-9, 3 * 2.0**-10, rng.normal(size=28) * 1e-3],  # E4M3 subnormals (< 2^-6)
        np.r_[500.0, rng.normal(size=31)],  # amax / 2^e in (448, 512): saturates to 448
        rng.normal(size=32) * 1e5,
        rng.standard_cauchy(32),  # heavy tails
    ]
    x = np.stack(blocks).astype(np.float32)
    v, s = quantize_mxfp8(jnp.asarray(x))
    v_ref, e_ref = mx_numpy(x)
    assert v.dtype == jnp.float8_e4m3fn and s.dtype == jnp.float8_e8m0fnu and s.shape == (7, 1)
    np.testing.assert_array_equal(np.asarray(v).view(np.uint8), v_ref.view(np.uint8))
    np.testing.assert_array_equal(_e8m0_exponent(s)[:, 0], e_ref[:, 0])
    assert _e8m0_exponent(s)[0, 0] == -127 and (np.asarray(v[0]).astype(np.float32) == 0).all()
    assert _e8m0_exponent(s)[1, 0] == 0 and float(v[1, 0]) == 448.0
    assert _e8m0_exponent(s)[2, 0] == -127
    assert float(dequantize_mxfp8(v, s)[3, 2]) == 2.0**-9  # a subnormal element survives exactly
    assert float(dequantize_mxfp8(v, s)[4, 0]) == 448.0  # saturated, as the spec accepts


@pytest.mark.parametrize("axis", [-1, 0])
def test_mxfp8_round_trip_error_bound(axis):
    x = jax.random.normal(jax.random.key(1), (64, 96)) * jnp.exp(jax.random.normal(jax.random.key(2), (64, 1)))
    v, s = quantize_mxfp8(x, axis=axis)
    y = dequantize_mxfp8(v, s, axis=axis)
    xb = np.moveaxis(np.asarray(x), axis, -1).reshape(-1, 32).astype(np.float64)
    yb = np.moveaxis(np.asarray(y), axis, -1).reshape(-1, 32)
    scale = 2.0 ** np.moveaxis(_e8m0_exponent(s), axis, -1).reshape(-1, 1)
    ratio = np.abs(xb) / scale
    # Inside E4M3's range: 3 mantissa bits (2^-4 relative) down to the subnormal step 2^-9 (half of it
    # lost at most); above 448 x scale the spec saturates, losing |x| - 448 x scale (< amax / 7).
    bound = np.where(ratio <= 448, np.maximum(np.abs(xb) * 2.0**-4, scale * 2.0**-10), np.abs(xb) - 448 * scale)
    assert (np.abs(yb - xb) <= bound * (1 + 1e-6)).all()
    assert (ratio > 448).any()  # the saturating band is exercised


def test_mxfp8_nan_and_inf_poison_only_their_block():
    x = jnp.ones((3, 32)).at[0, 5].set(jnp.nan).at[1, 7].set(jnp.inf)
    v, s = quantize_mxfp8(x)
    y = np.asarray(dequantize_mxfp8(v, s))
    assert np.isnan(y[0]).all() and np.isnan(y[1]).all()
    np.testing.assert_array_equal(y[2], 1.0)
    assert (np.asarray(jax.lax.bitcast_convert_type(s, jnp.uint8))[:2] == 0xFF).all()


def test_mxfp8_needs_whole_blocks():
    with pytest.raises(ValueError, match="size 48, not a multiple of the block size 32"):
        quantize_mxfp8(jnp.ones((2, 48)))


def test_fp8_kv_matches_flashmla_rule_and_bounds():
    x = np.random.default_rng(3).normal(size=(5, 3, 256)).astype(np.float32) * np.array([1e-6, 1.0, 300.0])[:, None]
    v, s = quantize_kv_fp8(jnp.asarray(x), tile=128)
    v_ref, s_ref = kv_numpy(x, 128)
    assert s.shape == (5, 3, 2) and s.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(s), s_ref)
    np.testing.assert_array_equal(np.asarray(v).view(np.uint8), v_ref.view(np.uint8))
    y = np.asarray(dequantize_kv_fp8(v, s))
    err = np.abs(y - x).reshape(5, 3, 2, 128)
    assert (err <= np.maximum(np.abs(x).reshape(err.shape) * 2.0**-4, s_ref[..., None] * 2.0**-10)).all()
    assert np.isnan(np.asarray(dequantize_kv_fp8(*quantize_kv_fp8(jnp.full((1, 128), jnp.nan))))).all()


@pytest.mark.parametrize("fmt, tile", [("fp8", 16), ("mxfp8", 0)])
def test_an_empty_quantized_pool_is_quantized_zeros_and_compiles_without_folding_them(fmt, tile):
    """Pool.empty broadcasts one quantized zero row: the same values and scales as quantizing a zero pool, and
    the program that builds it holds no pool-sized reduction (XLA constant-folded that at compile time)."""
    from hybrid_jax.cache import Pool, quantize_rows

    shape = (3, 4, 64)
    pool = Pool.empty(*shape, jnp.bfloat16, fmt, tile)
    want_v, want_s = quantize_rows(jnp.zeros(shape, jnp.float32), fmt, tile, jnp.bfloat16)
    for got, want in ((pool.values, want_v), (pool.scales, want_s)):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    hlo = jax.jit(lambda: Pool.empty(*shape, jnp.bfloat16, fmt, tile)).lower().as_text()
    reductions = [ln for ln in hlo.splitlines() if "stablehlo.reduce(" in ln]
    assert reductions and not any("tensor<3x4x" in ln for ln in reductions), reductions


def test_quant_config_yaml_and_errors(tmp_path):
    path = tmp_path / "quant.yaml"
    path.write_text("""
indexer: {dtype: mxfp8, granularity: per-group, group_size: 32}
kv_cache: {dtype: fp8, granularity: per-token-head-tile, tile_size: 128}
projection: {dtype: bf16}
""")
    assert QuantConfig.from_yaml(path) == QuantConfig.hierarchical()
    path.write_text("kv_cache: {dtype: none}\n")
    q = QuantConfig.from_yaml(path)
    assert not q.kv_cache.enabled and not q.indexer.enabled and q.projection.param_dtype is None
    with pytest.raises(ValueError, match=r"QuantConfig.indexer.group_size=16"):
        QuantConfig.from_dict({"indexer": {"dtype": "mxfp8", "group_size": 16}})
    with pytest.raises(ValueError, match=r"unknown part\(s\) \['weights'\]"):
        QuantConfig.from_dict({"weights": {"dtype": "fp8"}})
    with pytest.raises(ValueError, match=r"QuantConfig.kv_cache.dtype='int4'"):
        QuantConfig.from_dict({"kv_cache": {"dtype": "int4"}})


def _quant(indexer=True, kv=True, proj="none"):
    return QuantConfig(
        IndexerQuant("mxfp8" if indexer else "none"),
        KVCacheQuant("fp8" if kv else "none", tile_size=16),
        ProjectionQuant(proj),
    )


@pytest.mark.slow
def test_quantized_model_decodes_like_its_full_forward_and_the_cache_shrinks(tiny_cfg, jitted):
    model = HybridLM(tiny_cfg, quant=_quant(), rngs=nnx.Rngs(0))
    ids = random_ids(30, (2, 12))
    full = jitted["forward"](model, ids)
    stepped, cache = prefill_then_decode(model, ids, jitted, 5, 16)
    # On the CPU the cached and uncached paths compute bit-identical latents, so quantization rounds them
    # identically. Elsewhere GEMM rounding differs by shape, and a 1e-7 difference can move a value across
    # an FP8 rounding boundary (a 2^-4 relative step), so only a looser agreement is meaningful there.
    tol = 1e-4 if jax.default_backend() == "cpu" else 2e-2
    assert rel_err(stepped, full) < tol
    plain = HybridLM(tiny_cfg, rngs=nnx.Rngs(0))
    assert rel_err(full, jitted["forward"](plain, ids)) > 1e-4  # the quantization is really applied
    i = tiny_cfg.layer_types.index("sparse")
    q_state, p_state = cache.layers[i], plain.init_cache(2, 16).layers[i]
    nbytes = lambda tree: sum(x.nbytes for x in jax.tree_util.tree_leaves(tree))  # noqa: E731
    assert q_state.latent.values.dtype == jnp.float8_e4m3fn and q_state.index_k.values.dtype == jnp.float8_e4m3fn
    assert nbytes(q_state) < 0.45 * nbytes(p_state)


@pytest.mark.slow
@pytest.mark.parametrize(
    "indexer,kv,proj", [(i, k, p) for i in (0, 1) for k in (0, 1) for p in ("none", "bf16", "fp8")]
)
def test_every_combination_runs(tiny_cfg, indexer, kv, proj):
    model = HybridLM(tiny_cfg, quant=_quant(indexer, kv, proj), rngs=nnx.Rngs(0))
    want = {"none": jnp.float32, "bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}[proj]
    assert model.layers[0].self_attn.q_proj.kernel[...].dtype == want
    assert model.layers[0].self_attn.A_log[...].dtype == jnp.float32  # float32 by design, whatever the policy
    logits = jax.jit(lambda m, i: m(i))(model, random_ids(31, (1, 10)))
    assert np.isfinite(np.asarray(logits)).all()


def test_quant_shape_requirements_are_named(tiny_cfg):
    with pytest.raises(ValueError, match="tile_size=128 must divide kv_lora_rank=32"):
        HybridLM(tiny_cfg, quant=QuantConfig.hierarchical(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="index_head_dim=16"):
        HybridLM(tiny_cfg.replace(index_head_dim=16, index_rope_dim=8), quant=_quant(kv=False), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="param_dtype=float32 contradicts quant.projection.dtype='bf16'"):
        HybridLM(tiny_cfg, param_dtype=jnp.float32, quant=_quant(proj="bf16"), rngs=nnx.Rngs(0))
