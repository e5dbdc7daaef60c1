"""The model through its Pallas kernels (interpret mode on CPU, switched on by `use_pallas()`) against the
model through the jnp references: the wiring of pools, scales and states into the kernels."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from hybrid_jax import HybridLM
from pallas_kernels import use_pallas
from tests.conftest import fresh_jits as _fresh_jits
from tests.conftest import prefill_then_decode, random_ids, rel_err
from tests.test_quant import _quant


@pytest.mark.slow
@pytest.mark.parametrize("quantized", [False, True], ids=["bf16-pools", "fp8-latent+mxfp8-indexer"])
def test_model_through_pallas_kernels_matches_the_references(tiny_cfg, quantized):
    # the sparse MLA kernel reads rope tiles of >= 16 values; the indexer prolog kernel column groups of >= 16.
    # One layer of each type, a dense MLP and MoE (CI time: each layer compiles its own interpret-mode kernels)
    cfg = tiny_cfg.replace(qk_rope_head_dim=16, index_num_heads=16, index_head_dim=64, index_rope_dim=32)
    cfg = cfg.replace(num_layers=3, layer_types=("linear", "sparse", "full"), mlp_types=("dense", "moe", "moe"))
    model = HybridLM(cfg, quant=_quant() if quantized else None, rngs=nnx.Rngs(3))
    ids = random_ids(41, (2, 12))
    ref, ref_cache = prefill_then_decode(model, ids, _fresh_jits(), 9, 16)
    with use_pallas():
        jits = _fresh_jits()
        # the programs that run below, each traced once (a jit reuses its trace for the same argument types)
        empty = model.init_cache(2, 16)
        kernels = str(jits["decode"].trace(model, ids[:, 0], empty).jaxpr)
        kernels += str(jits["prefill"].trace(model, ids[:, :9], empty, jnp.full((2,), 9)).jaxpr)
        got, cache = prefill_then_decode(model, ids, jits, 9, 16)
    for name in (
        "sparse_mla",
        "indexer_scores",
        "indexer_prolog",
        "kda_decode",
        "kda_chunk",
        "moe_grouped_matmul",
        "flash_attention",
        "mla_decode",
    ):  # the kernels really run
        assert f"name={name}" in kernels, name
    assert rel_err(got, ref) < 1e-4
    for a, b in zip(jax.tree_util.tree_leaves(cache), jax.tree_util.tree_leaves(ref_cache), strict=True):
        assert rel_err(a.astype("float32"), b.astype("float32")) < 1e-4


def test_use_pallas_can_switch_single_ops(tiny_cfg):
    model = HybridLM(tiny_cfg.replace(qk_rope_head_dim=16), rngs=nnx.Rngs(0))
    ids = random_ids(42, (1, 9))
    with use_pallas(ops=["moe"]):
        only_moe = str(jax.make_jaxpr(lambda m, i: m(i))(model, ids))
    assert "name=moe_grouped_matmul" in only_moe
    assert "pallas_call" in only_moe and "name=kda_chunk" not in only_moe and "name=sparse_mla" not in only_moe
    assert "name=flash_attention" not in only_moe
    with pytest.raises(ValueError, match=r"unknown op\(s\) \['flash'\]"):
        with use_pallas(ops=["flash"]):
            pass
