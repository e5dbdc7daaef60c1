"""Qwen3-Next (`qwen3_next`) and Qwen3.5-MoE (`qwen3_5_moe`, text): Gated DeltaNet with grouped q/k heads, gated GQA
with partial RoPE and a paged K/V cache, softmax MoE with a gated shared expert, zero-centred norms; loading, caches,
quantization, sharding, the presets.

Parity of logits and greedy tokens with transformers is in tests/test_checkpoints.py (fixtures qwen3_next,
qwen3_5_moe)."""

import contextlib
import json
import logging
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from checkpoints import CheckpointError, config_from_hf, convert, from_pretrained, save_pretrained
from hybrid_jax import HybridConfig, HybridLM
from hybrid_jax.cache import AttnState
from hybrid_jax.generate import prefill_chunked
from hybrid_jax.quant.config import QuantConfig
from tests.conftest import prefill_then_decode, random_ids, rel_err

FIXTURE = Path(__file__).parent / "fixtures" / "qwen3_next"
FIXTURE_35 = Path(__file__).parent / "fixtures" / "qwen3_5_moe"


def qwen_tiny(**changes) -> HybridConfig:
    """Every qwen3_next feature at toy size: 6 value heads over 3 key heads with K != V, a 4-token conv, gated GQA
    (4 query / 2 kv heads, RoPE on 8 of 16 dims), a dense layer, softmax MoE with a gated shared expert."""
    cfg = HybridConfig(
        vocab_size=150, hidden_size=45, num_layers=4,
        layer_types=("linear", "attention", "linear", "attention"), mlp_types=("dense", "moe", "moe", "moe"),
        kda_num_heads=6, kda_num_k_heads=3, kda_head_dim=8, kda_v_head_dim=12, kda_scalar_decay=True,
        kda_decay_rank=None, kda_output_gate_rank=None, kda_norm_gate="silu", kda_chunk_size=8,
        num_heads=4, attn_num_kv_heads=2, attn_head_dim=16, attn_rope_dim=8, rope_theta=10000.0,
        num_experts=8, num_experts_per_tok=2, num_shared_experts=1, shared_expert_intermediate_size=20,
        shared_expert_gate=True, router_bias=False, scoring_func="softmax", moe_intermediate_size=12,
        intermediate_size=40, rms_norm_eps=1e-6, norm_zero_centered=True, page_size=8, max_position_embeddings=256,
    )  # fmt: skip
    return cfg.replace(**changes)


def _perturbed(cfg: HybridConfig, seed: int = 0, quant: QuantConfig | None = None) -> HybridLM:
    """A model whose zero-initialised norm weights are moved off zero (a 1 vs 1 + w mix-up shows)."""
    model = HybridLM(cfg, quant=quant, rngs=nnx.Rngs(seed))
    state = nnx.state(model, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(seed + 100), len(jax.tree.leaves(state))))
    state = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(next(keys), x.shape, x.dtype), state)
    nnx.update(model, state)
    return model


# ------------------------------------------------------------------------------------------------ the model
@pytest.mark.slow
def test_decode_chunked_prefill_and_verify_reproduce_the_full_forward(jitted):
    """Prefill + decode, a chunked prefill (chunks of 8 and tail calls of 3) and a verify + commit over the cache
    give the forward's logits; the attention layers keep K/V pools, the GDN layers [N, K, V] states."""
    cfg = qwen_tiny()
    model = _perturbed(cfg)
    ids = random_ids(21, (2, 29), cfg.vocab_size)  # 29: not a multiple of the chunk (8) or the page (8)
    full = jitted["forward"](model, ids)
    stepped, cache = prefill_then_decode(model, ids, jitted, 13, 40)
    assert rel_err(stepped, full) < 1e-5
    assert isinstance(cache.layers[1], AttnState) and cache.layers[1].k.values.shape[-1] == 2 * 16
    assert cache.layers[0].recurrent.shape == (2, 6, 8, 12)
    assert cache.layers[0].conv.shape == (2, 3, 2 * 3 * 8 + 6 * 12)
    logits, chunked = prefill_chunked(model, ids, model.init_cache(2, 40), jnp.full((2,), 29), chunk=8, tail_chunk=3)
    assert rel_err(logits, full[jnp.arange(2), 28]) < 1e-5
    for a, b in zip(jax.tree.leaves(chunked), jax.tree.leaves(cache), strict=True):
        assert rel_err(a, b) < 1e-5
    # verify 5 tokens after 20, keep 3 for row 0 and all 5 for row 1: the kept tokens' logits and a cache equal
    # to prefilling only them (K/V pool rows of the rejected tokens cleared)
    base = jitted["prefill"](model, ids[:, :20], model.init_cache(2, 40), jnp.full((2,), 20))[1]
    vlogits, pending = jax.jit(lambda m, i, c: m.verify(i, c))(model, ids[:, 20:25], base)
    assert rel_err(vlogits, full[:, 20:25]) < 1e-5
    keep = jnp.array([3, 5])
    got = jax.jit(lambda m, p, k: m.commit(p, k))(model, pending, keep)
    want = jitted["prefill"](model, ids[:, 20:25], base, keep)[1]
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-5)


def test_grouped_heads_read_their_key_head():
    """Value heads 2j and 2j + 1 read q / k head j: giving every key head the same q / k projection columns (and
    conv taps) makes the layer equal to one with a single key head."""
    from hybrid_jax.cache import StepInfo

    cfg = qwen_tiny(num_layers=1, layer_types=("linear",), mlp_types=("dense",))
    grouped = _perturbed(cfg).layers[0].self_attn
    single = _perturbed(cfg.replace(kda_num_k_heads=1)).layers[0].self_attn
    hd = cfg.kda_head_dim
    for name in ("q_proj", "k_proj"):
        w = getattr(single, name).kernel[...]  # [D, K]
        getattr(grouped, name).kernel.set_value(jnp.tile(w, (1, 3)))
    for name in ("q_conv1d", "k_conv1d"):
        getattr(grouped, name).kernel.set_value(jnp.tile(getattr(single, name).kernel[...], (1, 3)))
    for name in ("v_proj", "f_proj", "b_proj", "g_proj", "o_proj", "v_conv1d", "o_norm"):
        nnx.update(getattr(grouped, name), nnx.state(getattr(single, name)))
    grouped.A_log.set_value(single.A_log[...])
    grouped.dt_bias.set_value(single.dt_bias[...])
    x = jax.random.normal(jax.random.key(3), (2, 11, cfg.hidden_size))
    info = StepInfo(
        positions=jnp.broadcast_to(jnp.arange(11), (2, 11)), valid=jnp.ones((2, 11), bool), n_new=jnp.full((2,), 11),
        page_table=jnp.arange(2)[:, None], kv_lengths=jnp.full((2,), 11), mode="prefill",
    )  # fmt: skip
    assert hd == 8 and rel_err(grouped(x, info, None)[0], single(x, info, None)[0]) < 1e-6


def _grouped_layer_inputs(seed, b, n, nk, dk, dv, w, dtype):
    """Random inputs of `kda_decode_layer` in Qwen's layout (N_k q/k heads of K, N value heads of V, scalar
    decay); row 1 padded."""
    ks = iter(jax.random.split(jax.random.key(seed), 20))
    c, cv = nk * dk, n * dv
    q, k = (jax.random.normal(next(ks), (b, c), dtype) for _ in range(2))
    v, z = (jax.random.normal(next(ks), (b, cv), dtype) for _ in range(2))
    conv_state = jax.random.normal(next(ks), (b, w - 1, 2 * c + cv), dtype)
    weights = tuple(0.5 * jax.random.normal(next(ks), (w, x)) for x in (c, c, cv))
    f, b_logits = (jax.random.normal(next(ks), (b, n), dtype) for _ in range(2))
    a_log = jax.random.uniform(next(ks), (n,), minval=-1.0, maxval=1.0)
    dt_bias = 0.5 * jax.random.normal(next(ks), (n,))
    norm = 1.0 + 0.1 * jax.random.normal(next(ks), (dv,))
    state = jax.random.normal(next(ks), (b, n, dk, dv))
    valid = jnp.arange(b) != 1
    return (q, k, v, conv_state, weights, f, a_log, dt_bias, b_logits, z, norm, state, valid, valid.astype(jnp.int32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_decode_layer_kernel_takes_the_grouped_layout(dtype):
    """The fused decode-layer kernel (interpret mode) in Qwen's layout — 4 value heads of V = 32 over 2 q/k heads
    of K = 16, SiLU output gate — equals its reference: outputs, state, conv tails moved exactly; the padded row
    keeps both states."""
    from pallas_kernels.linear_attention import kda_decode_layer

    args = _grouped_layer_inputs(1, 3, 4, 2, 16, 32, 4, dtype)
    kw = dict(num_heads=4, head_dim=16, scalar_decay=True, num_k_heads=2, v_head_dim=32, gate="silu", eps=1e-6)
    y_ref, conv_ref, s_ref = kda_decode_layer(*args, impl="reference", **kw)
    y, conv, s = kda_decode_layer(*args, impl="pallas", interpret=True, **kw)
    assert y.shape == (3, 4, 32) and y.dtype == dtype and conv.shape == args[3].shape and s.dtype == jnp.float32
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    assert rel_err(y, y_ref) < tol and rel_err(s, s_ref) < 1e-4
    np.testing.assert_array_equal(np.asarray(conv, np.float32), np.asarray(conv_ref, np.float32))
    np.testing.assert_array_equal(np.asarray(conv[1], np.float32), np.asarray(args[3][1], np.float32))
    np.testing.assert_allclose(np.asarray(s[1]), np.asarray(args[11][1]), rtol=1e-6)
    assert not np.array_equal(np.asarray(conv[0], np.float32), np.asarray(args[3][0], np.float32))
    with pytest.raises(ValueError, match=r"q \| k channels 64 are not a multiple of the value head dim 128"):
        big = _grouped_layer_inputs(1, 1, 2, 2, 16, 128, 4, dtype)
        kda_decode_layer(*big, impl="pallas", interpret=True, **{**kw, "num_heads": 2, "v_head_dim": 128})


@pytest.mark.slow
def test_model_decode_and_verify_through_the_grouped_fused_layer_kernel(jitted):
    """A Qwen-layout model (3 q/k heads of 16 over 6 value heads of 32) decoding and verifying with the fused
    decode-layer kernel forced gives the unfused path's logits and caches."""
    from pallas_kernels import use_pallas
    from tests.conftest import fresh_jits

    cfg = qwen_tiny(kda_head_dim=16, kda_v_head_dim=32)
    model = _perturbed(cfg, seed=2)
    ids = random_ids(31, (2, 12), cfg.vocab_size)
    first, start = jitted["prefill"](model, ids[:, :8], model.init_cache(2, 24), jnp.full((2,), 8))
    verify = lambda m, i, c: m.verify(i, c)  # noqa: E731
    runs = {}
    for fused in (False, True):
        with use_pallas(ops=["kda_decode_layer"]) if fused else contextlib.nullcontext():
            decode = fresh_jits()["decode"]
            if fused:
                assert "name=kda_decode_layer" in str(decode.trace(model, ids[:, 8], start).jaxpr)
            cache, steps = start, []
            for i in range(8, 12):
                lg, cache = decode(model, ids[:, i], cache)
                steps.append(lg)
            vlogits, pending = jax.jit(verify)(model, ids[:, 8:12], start)
        runs[fused] = (jnp.stack(steps, 1), cache, vlogits, pending.cache)
    for a, b in zip(jax.tree.leaves(runs[True]), jax.tree.leaves(runs[False]), strict=True):
        assert rel_err(a.astype(jnp.float32), b.astype(jnp.float32)) < 1e-5


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(kda_num_k_heads=4), r"kda_num_k_heads=4: must be positive and divide kda_num_heads=6"),
        (dict(kda_scalar_decay=False), r"kda_num_k_heads=3: grouped q/k heads need the scalar"),
        (dict(kda_norm_gate="relu"), r"kda_norm_gate='relu'"),
        (dict(attn_num_kv_heads=3), r"attn_num_kv_heads=3: must divide num_heads=4"),
        (dict(attn_rope_dim=18), r"attn_rope_dim=18: must be even and in \[0, attn_head_dim=16\]"),
        (dict(attn_head_dim=0), r"attn_head_dim=0: must be positive"),
        (dict(shared_expert_intermediate_size=0), r"shared_expert_intermediate_size=0"),
        (dict(num_shared_experts=0, shared_expert_intermediate_size=None), r"shared_expert_gate=True: needs a shared"),
    ],
)
def test_bad_qwen_configs_name_the_field(changes, match):
    with pytest.raises(ValueError, match=match):
        qwen_tiny(**changes)


def test_qwen3_next_preset_has_the_released_parameter_count():
    """transformers 5.23's Qwen3NextForCausalLM built on the meta device with Qwen3-Next-80B-A3B's config.json
    holds 79,674,391,296 parameters (no buffers but the rotary tables)."""
    import math

    cfg = HybridConfig.qwen3_next_80b()
    model = nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0)))
    assert sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == 79_674_391_296
    assert cfg.layer_pattern == "LLLA" * 12


def test_qwen3_5_moe_preset_has_transformers_parameter_count():
    """transformers 5.23's Qwen3_5MoeForConditionalGeneration with the default config holds 34,660,610,688
    parameters outside its vision tower (`model.visual.*`)."""
    import math

    cfg = HybridConfig.qwen3_5_moe_35b()
    model = nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0)))
    assert sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == 34_660_610_688
    assert cfg.layer_pattern == "LLLA" * 10


# ------------------------------------------------------------------------------------------------ loading
def test_qwen3_next_config_styles_and_refusals():
    """The released config.json's flat rope_theta / partial_rotary_factor / full_attention_interval map like
    transformers' rope_parameters / layer_types; fields left out take transformers' defaults; what would change
    the math is refused naming the field."""
    raw = json.loads((FIXTURE / "config.json").read_text())
    cfg = config_from_hf(raw)
    assert cfg.layer_pattern == "lALLA" and cfg.attn_rope_dim == 8 and cfg.kda_v_dim == 12
    assert cfg.shared_expert_gate and not cfg.router_bias and cfg.norm_zero_centered
    rp = raw["rope_parameters"]
    released = {k: v for k, v in raw.items() if k not in ("rope_parameters", "layer_types")}
    released.update(rope_theta=rp["rope_theta"], partial_rotary_factor=rp["partial_rotary_factor"], rope_scaling=None)
    released.update(full_attention_interval=4, num_hidden_layers=8, mtp_num_hidden_layers=1, use_sliding_window=False)
    flat = config_from_hf(released)
    assert flat.layer_types == ("linear",) * 3 + ("attention",) + ("linear",) * 3 + ("attention",)
    assert (flat.attn_rope_dim, flat.rope_theta) == (cfg.attn_rope_dim, cfg.rope_theta)
    minimal = config_from_hf({"model_type": "qwen3_next"})
    assert minimal == HybridConfig.qwen3_next_80b().replace(
        intermediate_size=5632, max_position_embeddings=32768, rope_theta=10000.0, bos_token_id=None,
        eos_token_id=None,
    )  # fmt: skip
    for change, match in (
        ({"use_sliding_window": True}, r"use_sliding_window=true is not supported"),
        ({"rope_parameters": {**rp, "rope_type": "yarn"}}, r"rope type 'yarn'"),
        ({"rope_parameters": {**rp, "partial_rotary_factor": 1.5}}, r"partial_rotary_factor=1.5 is more than 1"),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
        ({"layer_types": ["linear_attention"] * 4}, r"layer_types=.*need 5 of"),
        ({"linear_num_key_heads": 4}, r"kda_num_k_heads=4: must be positive and divide kda_num_heads=6"),
        ({"attention_bias": True}, r"attention_bias=True is not supported"),
    ):
        with pytest.raises(CheckpointError, match=match):
            config_from_hf({**raw, **change})


def test_qwen3_5_moe_config_nested_or_flat_and_refusals():
    """The multimodal wrapper (text_config + vision_config) and a flat qwen3_5_moe_text file map alike; RoPE's
    multimodal sections are accepted (text positions: plain RoPE); Qwen3-Next's dense-layer fields are not
    qwen3_5_moe fields and are refused, as is any other unknown field."""
    raw = json.loads((FIXTURE_35 / "config.json").read_text())
    nested = config_from_hf(raw)
    assert nested == config_from_hf(raw["text_config"])  # model_type qwen3_5_moe_text
    assert nested.layer_pattern == "LALLA" and nested.kda_num_heads == 4 and nested.attn_rope_dim == 8
    assert config_from_hf({"model_type": "qwen3_5_moe"}) == HybridConfig.qwen3_5_moe_35b()
    text = raw["text_config"]
    for change, where, match in (
        ({"decoder_sparse_step": 1}, "text", r"unknown field\(s\) \['decoder_sparse_step'\]"),
        ({"mlp_only_layers": [0]}, "text", r"unknown field\(s\) \['mlp_only_layers'\]"),
        ({"rope_parameters": {**text["rope_parameters"], "mrope_section": [2, 1]}}, "text", r"mrope_section=\[2, 1\]"),
        ({"audio_config": {}}, "top", r"unknown top-level field\(s\) \['audio_config'\]"),
        ({"tie_word_embeddings": True}, "top", r"tie_word_embeddings=True at the top level but False"),
    ):
        bad = {**raw, "text_config": {**text, **change}} if where == "text" else {**raw, **change}
        with pytest.raises(CheckpointError, match=match):
            config_from_hf(bad)
    qwen_next = json.loads((FIXTURE / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"rope_parameters has unknown field\(s\) \['mrope_section'\]"):
        config_from_hf({**qwen_next, "rope_parameters": {**qwen_next["rope_parameters"], "mrope_section": [1, 1, 2]}})


def _split_qwen35_names(tensors: dict, cfg: dict) -> dict:
    """The fixture's fused GDN projections rewritten in qwen3_5's split layout (in_proj_qkv | z | b | a)."""
    nk, n = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, r = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], n // nk
    out = {}
    for k, v in tensors.items():
        if k.endswith("in_proj_qkvz.weight"):
            base, w = k[: -len("in_proj_qkvz.weight")], v.reshape(nk, 2 * (dk + r * dv), -1)
            q, kk, vv, z = np.split(w, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
            out[base + "in_proj_qkv.weight"] = np.concatenate([x.reshape(-1, w.shape[-1]) for x in (q, kk, vv)])
            out[base + "in_proj_z.weight"] = z.reshape(-1, w.shape[-1])
        elif k.endswith("in_proj_ba.weight"):
            base, w = k[: -len("in_proj_ba.weight")], v.reshape(nk, 2 * r, -1)
            out[base + "in_proj_b.weight"] = w[:, :r].reshape(n, -1)
            out[base + "in_proj_a.weight"] = w[:, r:].reshape(n, -1)
        else:
            out[k] = v
    return out


def test_qwen3_next_loads_split_projections_skips_mtp_and_rejects_strays(tmp_path, caplog):
    """The same weights in qwen3_5's split GDN layout (in_proj_qkv / z / b / a) load to the same model; a released
    checkpoint's `mtp.*` module is skipped with one log line; any other stray tensor is still an error."""
    from checkpoints.safetensors_io import CheckpointFolder, write_safetensors

    src = CheckpointFolder(FIXTURE)
    tensors = {k: np.array(src[k]) for k in src}
    raw = json.loads((FIXTURE / "config.json").read_text())
    d = tmp_path / "split"
    d.mkdir()
    shutil.copy(FIXTURE / "config.json", d)
    mtp = {"mtp.fc.weight": np.zeros((4, 4), np.float32), "mtp.layers.0.input_layernorm.weight": np.zeros(4)}
    write_safetensors(d / "model.safetensors", {**_split_qwen35_names(tensors, raw), **mtp})
    ref = np.load(FIXTURE / "reference.npz")
    with caplog.at_level(logging.INFO, logger="hybrid_jax.checkpoints"):
        model = from_pretrained(d, dtype=jnp.float32, progress=False)
    assert sum("multi-token-prediction" in r.message for r in caplog.records) == 1
    logits = np.asarray(jax.jit(lambda m, i: m(i))(model, jnp.asarray(ref["input_ids"])))
    assert np.abs(logits - ref["logits"]).max() / np.abs(ref["logits"]).max() <= 1e-5
    write_safetensors(d / "model.safetensors", {**tensors, "model.layers.0.linear_attn.extra": np.zeros(2)})
    with pytest.raises(CheckpointError, match=r"1 unexpected tensor\(s\).*linear_attn.extra"):
        from_pretrained(d, dtype=jnp.float32, progress=False)


@pytest.mark.slow
def test_qwen_fp8_kv_cache_orbax_save_and_cli(tmp_path, capsys, jitted):
    """An FP8 K/V cache (one scale per 8 values of a token) decodes consistently and stays near float32 (on the
    qwen3_5_moe fixture); orbax `convert` and our `save_pretrained` reload the same weights and the CLI generates
    the greedy tokens (qwen3_next)."""
    from hybrid_jax.cli import main
    from hybrid_jax.memory import cache_bytes

    ref = np.load(FIXTURE_35 / "reference.npz")
    ids = jnp.asarray(ref["input_ids"])
    quant = QuantConfig.from_dict({"kv_cache": {"dtype": "fp8", "tile_size": 8}})
    model = from_pretrained(FIXTURE_35, dtype=jnp.float32, quant=quant, progress=False)
    assert model.init_cache(2, 96).layers[1].k.values.dtype == jnp.float8_e4m3fn
    full = jitted["forward"](model, ids)
    stepped, _ = prefill_then_decode(model, ids, jitted, 70, 96)
    assert rel_err(stepped, full) < 1e-4  # the quantized cache reads back what the forward used
    assert 1e-5 < rel_err(full, ref["logits"]) < 0.05  # quantized: near the float32 reference, not equal
    kv = 2 * 16  # 2 kv heads x 16
    assert cache_bytes(model.config, quant, jnp.bfloat16)["attention K/V / token"] == 2 * (kv + kv / 8 * 4)

    ref = np.load(FIXTURE / "reference.npz")
    base = from_pretrained(FIXTURE, dtype=jnp.float32, progress=False)
    convert(FIXTURE, tmp_path / "orbax", dtype=jnp.float32, progress=False)
    save_pretrained(base, tmp_path / "hybrid")
    graph, want = nnx.split(base)
    for folder in ("orbax", "hybrid"):
        reloaded = from_pretrained(tmp_path / folder, dtype=jnp.float32, progress=False)
        again_graph, again = nnx.split(reloaded)
        assert reloaded.config == base.config and again_graph == graph, folder
        for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(want), strict=True):
            assert a.dtype == b.dtype, folder
            np.testing.assert_array_equal(a, b, err_msg=folder)

    prompt = ",".join(str(i) for i in ref["input_ids"][1].tolist())
    argv = ["generate", "--model", str(FIXTURE), "--prompt-ids", prompt, "--max-new-tokens", "16", "--quiet"]
    assert main([*argv, "--dtype", "float32", "--compile-cache", ""]) == 0
    tokens = capsys.readouterr().out.strip().splitlines()[-1]
    assert tokens == ",".join(str(i) for i in ref["generated"][1].tolist())


@pytest.mark.slow
def test_qwen3_next_context_and_tensor_parallel_equal_one_device():
    """CP prefill (zigzag with a 5-token cached head: state-parallel GDN, K/V gathered for the attention layers;
    sequential without) and TP on 8 fake devices give the single-device logits, caches and next decode step."""
    from tests.test_context_parallel import assert_cp_tp_equal_one_device

    setup = """
        from tests.test_qwen3_next import qwen_tiny
        cfg = qwen_tiny(hidden_size=48)  # the sequence-parallel residual splits D over tp
    """
    assert_cp_tp_equal_one_device(setup)
