"""HybridConfig validation and the full-size presets, checked without allocating (nnx.eval_shape)."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from hybrid_jax import HybridConfig, HybridLM


def _param_shapes(cfg):
    model = nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0)))
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {".".join(map(str, k)): tuple(v.get_value().shape) for k, v in flat}


def test_kimi_linear_48b_has_exactly_the_released_parameter_count():
    shapes = _param_shapes(HybridConfig.kimi_linear_48b())
    assert sum(int(np.prod(s)) for s in shapes.values()) == 49_122_681_728
    assert shapes["layers.26.self_attn.kv_b_proj.kernel"] == (512, 8192)  # the last layer is MLA
    assert shapes["layers.25.self_attn.q_conv1d.kernel"] == (4, 4096)
    assert shapes["layers.1.mlp.experts.gate_proj"] == (256, 2304, 1024)
    assert shapes["layers.0.mlp.gate_proj.kernel"] == (2304, 9216)


def test_deepseek_v32_shapes():
    cfg = HybridConfig.deepseek_v32()
    shapes = _param_shapes(cfg)
    assert shapes["layers.0.self_attn.indexer.wq_b.kernel"] == (1536, 64 * 128)
    assert shapes["layers.0.self_attn.q_b_proj.kernel"] == (1536, 128 * 192)
    assert shapes["layers.60.mlp.experts.down_proj"] == (256, 2048, 7168)
    # DeepSeek-V3's main model (671,026,419,200 values) plus V3.2's indexer in each of the 61 layers.
    indexer = 1536 * 8192 + 7168 * 128 + 2 * 128 + 7168 * 64
    assert sum(int(np.prod(s)) for s in shapes.values()) == 671_026_419_200 + 61 * indexer
    assert cfg.softmax_scale == pytest.approx(0.135234, abs=1e-6)


def test_hybrid_small_is_one_to_two_billion_parameters():
    cfg = HybridConfig.hybrid_small()
    n = sum(int(np.prod(s)) for s in _param_shapes(cfg).values())
    assert 1e9 <= n <= 2e9
    assert cfg.layer_types.count("linear") == 3 * cfg.layer_types.count("sparse")


def test_tiny_has_every_feature():
    cfg = HybridConfig.tiny()
    assert set(cfg.layer_types) == {"linear", "full", "sparse"}
    assert set(cfg.mlp_types) == {"dense", "moe"}
    assert cfg.attn_res_block_size and cfg.q_lora_rank and cfg.rope_scaling and cfg.mla_output_gate
    assert cfg.n_group > 1 and cfg.num_shared_experts > 0 and cfg.index_rope_dim > 0


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(layer_types=("linear",) * 5), r"layer_types=.*5 entries, num_layers=6"),
        (dict(layer_types=("linear", "mamba", "sparse", "full", "linear", "sparse")), r"layer_types\[1\]='mamba'"),
        (dict(mlp_types=("dense",) * 5 + ("ffn",)), r"mlp_types\[5\]='ffn'"),
        (dict(num_experts_per_tok=9), r"num_experts_per_tok=9.*num_experts=8"),
        (dict(n_group=3), r"n_group=3.*must divide num_experts=8"),
        (dict(topk_group=3), r"topk_group=3"),
        (dict(index_topk=0), r"index_topk=0"),
        (dict(kda_gate_lower_bound=-7.0), r"kda_gate_lower_bound=-7.0"),
        (dict(kda_scalar_decay=True), r"kda_decay_rank=16.*scalar-decay"),
        (dict(mla_use_rope=False), r"rope_scaling=.*NoPE"),
        (dict(qk_rope_head_dim=7), r"qk_rope_head_dim=7"),
        (dict(eos_token_id=288), r"eos_token_id=288.*outside the vocabulary"),
        (dict(attn_res_block_size=0), r"attn_res_block_size=0"),
        (dict(index_rope_dim=40), r"index_rope_dim=40"),
    ],
)
def test_contradictory_fields_raise_naming_the_value(changes, match):
    with pytest.raises(ValueError, match=match):
        HybridConfig.tiny().replace(**changes)


def test_json_roundtrip_and_unknown_field(tmp_path):
    cfg = HybridConfig.tiny()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_dict()))
    assert HybridConfig.from_json(path) == cfg
    with pytest.raises(ValueError, match="unknown field.*'sliding_window'"):
        HybridConfig.from_dict({**cfg.to_dict(), "sliding_window": 128})


def test_params_carry_logical_axes(tiny_model):
    flat = nnx.to_flat_state(nnx.state(tiny_model, nnx.Param))
    missing = [
        ".".join(map(str, k))
        for k, v in flat
        if len(v.get_metadata().get("logical_axes", ())) != np.ndim(v.get_value())
    ]
    assert not missing, missing
    assert jax.tree_util.tree_leaves(nnx.state(tiny_model, nnx.Param))
