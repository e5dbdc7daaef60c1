"""Day-0 loading: parity with transformers on the committed fixtures, formats, conversion and bad input."""

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from checkpoints import CheckpointError, config_from_hf, convert, from_pretrained, save_pretrained
from checkpoints.safetensors_io import CheckpointFolder, SafetensorsFile, write_safetensors
from hybrid_jax import HybridConfig, HybridLM, generate

FIXTURES = Path(__file__).parent / "fixtures"
GEN = jax.jit(generate, static_argnames=("max_new_tokens",))


@pytest.fixture(scope="module", params=["kimi_linear", "deepseek_v32"])
def fixture(request):
    d = FIXTURES / request.param
    return d, from_pretrained(d, dtype=jnp.float32, progress=False), np.load(d / "reference.npz")


def test_logits_match_transformers(fixture):
    _, model, ref = fixture
    logits = np.asarray(jax.jit(lambda m, i: m(i))(model, jnp.asarray(ref["input_ids"])))
    max_rel = np.abs(logits - ref["logits"]).max() / np.abs(ref["logits"]).max()
    assert max_rel <= 1e-4


def test_greedy_generation_matches_transformers(fixture):
    _, model, ref = fixture
    out = GEN(model, jnp.asarray(ref["input_ids"]), max_new_tokens=ref["generated"].shape[1])
    np.testing.assert_array_equal(out.tokens, ref["generated"])


def test_fixtures_exercise_what_they_claim():
    kimi = config_from_hf(json.loads((FIXTURES / "kimi_linear/config.json").read_text()))
    ds = config_from_hf(json.loads((FIXTURES / "deepseek_v32/config.json").read_text()))
    seq = np.load(FIXTURES / "kimi_linear/reference.npz")["input_ids"].shape[1]
    assert {"linear", "full"} <= set(kimi.layer_types) and seq > kimi.kda_chunk_size and seq % kimi.kda_chunk_size
    assert kimi.num_experts > kimi.num_experts_per_tok and ds.num_experts > ds.num_experts_per_tok
    assert ds.index_topk < seq and ds.rope_scaling is not None
    assert sum(f.stat().st_size for f in FIXTURES.rglob("*") if f.is_file()) < 5e6


def test_released_kimi_config_style_maps_like_the_in_tree_style():
    in_tree = json.loads((FIXTURES / "kimi_linear/config.json").read_text())
    released = {
        k: v
        for k, v in in_tree.items()
        if k not in ("layer_types", "mlp_layer_types", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim")
    }
    released["mla_use_nope"] = True
    assert config_from_hf(released) == config_from_hf(in_tree)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"model_type": "llama"}, "unknown model_type 'llama'; supported: kimi_linear, deepseek_v32, hybrid"),
        ({"sliding_window": 4096}, r"unknown field\(s\) \['sliding_window'\]"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"mla_use_nope": False}, "mla_use_nope=false"),
        ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
    ],
)
def test_config_that_would_change_the_math_is_rejected(change, match):
    d = {**json.loads((FIXTURES / "kimi_linear/config.json").read_text()), **change}
    with pytest.raises(CheckpointError, match=match):
        config_from_hf(d)


def _copy_fixture(tmp_path, name="kimi_linear"):
    d = tmp_path / name
    shutil.copytree(FIXTURES / name, d)
    return d


def _rewrite(folder: Path, edit):
    f = CheckpointFolder(folder)
    tensors = {k: np.array(f[k]) for k in f}
    edit(tensors)
    del f
    write_safetensors(folder / "model.safetensors", tensors)


def test_missing_tensor_is_named_with_the_file(tmp_path):
    d = _copy_fixture(tmp_path)
    _rewrite(d, lambda t: t.pop("model.layers.2.self_attn.kv_b_proj.weight"))
    with pytest.raises(CheckpointError, match=r"'model.layers.2.self_attn.kv_b_proj.weight'.*model.safetensors"):
        from_pretrained(d, progress=False)


def test_shape_mismatch_names_both_shapes(tmp_path):
    d = _copy_fixture(tmp_path)
    _rewrite(d, lambda t: t.update({"model.norm.weight": np.ones(65, np.float32)}))
    with pytest.raises(CheckpointError, match=r"'model.norm.weight'.*shape \(65,\).*\(64,\)"):
        from_pretrained(d, progress=False)


def test_unexpected_tensors_are_listed_unless_not_strict(tmp_path):
    d = _copy_fixture(tmp_path)
    _rewrite(d, lambda t: t.update({"model.layers.0.self_attn.extra_bias": np.zeros(3, np.float32)}))
    with pytest.raises(CheckpointError, match="1 unexpected tensor.*extra_bias.*strict=False"):
        from_pretrained(d, progress=False)
    assert isinstance(from_pretrained(d, strict=False, progress=False), HybridLM)


def test_truncated_and_corrupted_files_fail_clearly(tmp_path):
    d = _copy_fixture(tmp_path)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        from_pretrained(d, progress=False)
    (d / "model.safetensors").write_bytes(data[:8] + b"{not json" + data[17:])
    with pytest.raises(CheckpointError, match="corrupted safetensors header"):
        SafetensorsFile(d / "model.safetensors")
    (d / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(CheckpointError, match="header length"):
        SafetensorsFile(d / "model.safetensors")


def test_sharded_folder_with_index_and_fp8_block_scaled_weights(tmp_path):
    """DeepSeek ships FP8 e4m3 weights with one float32 scale per 128x128 block, in index-listed shards."""
    src = CheckpointFolder(FIXTURES / "deepseek_v32")
    tensors = {k: np.array(src[k]) for k in src}
    name = "model.layers.1.self_attn.q_b_proj.weight"  # [96, 24]
    w = tensors[name]
    scale = np.array([[0.5]], np.float32)  # one block covers the whole (small) matrix
    w8 = np.clip(w / scale[0, 0], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    tensors[name] = w8
    tensors[name + "_scale_inv"] = scale
    d = tmp_path / "ds_fp8"
    d.mkdir()
    shutil.copy(FIXTURES / "deepseek_v32/config.json", d)
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        write_safetensors(d / fname, {k: tensors[k] for k in part})
        weight_map.update(dict.fromkeys(part, fname))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = from_pretrained(d, dtype=jnp.float32, progress=False)
    got = np.asarray(model.layers[1].self_attn.q_b_proj.kernel[...])
    np.testing.assert_array_equal(got, (w8.astype(np.float32) * 0.5).T)


def test_hybrid_format_round_trip(tmp_path):
    model = HybridLM(HybridConfig.tiny(), rngs=nnx.Rngs(3))
    save_pretrained(model, tmp_path / "tiny")
    with pytest.warns(UserWarning, match="no tokenizer.json"):
        back = from_pretrained(tmp_path / "tiny", dtype=jnp.float32, progress=False)
    assert back.config == model.config
    for a, b in zip(
        jax.tree_util.tree_leaves(nnx.state(model)), jax.tree_util.tree_leaves(nnx.state(back)), strict=True
    ):
        np.testing.assert_array_equal(a, b)


def test_convert_is_atomic_and_refuses_to_overwrite(tmp_path, monkeypatch):
    out = tmp_path / "orbax"
    convert(FIXTURES / "kimi_linear", out, dtype=jnp.float32, progress=False)
    with pytest.raises(FileExistsError, match="--force"):
        convert(FIXTURES / "kimi_linear", out, progress=False)
    restored = from_pretrained(out, dtype=jnp.float32)
    ref = from_pretrained(FIXTURES / "kimi_linear", dtype=jnp.float32, progress=False)
    for a, b in zip(
        jax.tree_util.tree_leaves(nnx.state(restored)), jax.tree_util.tree_leaves(nnx.state(ref)), strict=True
    ):
        np.testing.assert_array_equal(a, b)

    import checkpoints.orbax_io as orbax_io

    def broken(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(orbax_io.shutil, "copy2", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        convert(FIXTURES / "kimi_linear", out, force=True, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["orbax"]  # no half-written folder left behind
    assert from_pretrained(out, dtype=jnp.float32) is not None  # the old checkpoint is intact


def test_orbax_restore_on_8_fake_devices_carries_the_rule_shardings(tmp_path):
    out = tmp_path / "orbax"
    convert(FIXTURES / "deepseek_v32", out, dtype=jnp.float32, progress=False)
    script = textwrap.dedent(f"""
        import jax, numpy as np, jax.numpy as jnp
        from flax import nnx
        from checkpoints import from_pretrained
        from sharding import param_sharding
        assert jax.device_count() == 8
        mesh = jax.make_mesh((4, 2), ("dp", "tp"))
        model = from_pretrained({str(out)!r}, dtype=jnp.float32, mesh=mesh)
        ref = from_pretrained({str(FIXTURES / "deepseek_v32")!r}, dtype=jnp.float32, progress=False)
        flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
        flat_ref = dict(nnx.to_flat_state(nnx.state(ref, nnx.Param)))
        sharded = 0
        for path, var in flat:
            value = var.get_value()
            want = param_sharding(var, mesh)
            assert value.sharding.is_equivalent_to(want, value.ndim), (path, value.sharding, want)
            np.testing.assert_array_equal(np.asarray(value), np.asarray(flat_ref[path].get_value()))
            sharded += any(s is not None for s in want.spec)
        assert sharded > 10, sharded
        print("OK", len(flat), sharded)
    """)
    env = {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
    }
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_tokenizer_json_is_loaded_and_absence_is_explained(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from checkpoints import load_tokenizer

    d = _copy_fixture(tmp_path)
    with pytest.warns(UserWarning, match="no tokenizer.json: pass token ids"):
        assert load_tokenizer(d) is None
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 5, "world": 9}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    assert load_tokenizer(d).encode("hello world").ids == [5, 9]


def test_from_pretrained_applies_a_quant_policy(tmp_path):
    q = tmp_path / "q.yaml"
    q.write_text("kv_cache: {dtype: fp8, tile_size: 16}\nprojection: {dtype: bf16}\n")
    model = from_pretrained(FIXTURES / "kimi_linear", dtype=jnp.float32, quant=q, progress=False)
    assert model.layers[2].self_attn.kv_b_proj.kernel[...].dtype == jnp.bfloat16
    assert model.layers[0].self_attn.A_log[...].dtype == jnp.float32
    cache = model.init_cache(1, 8)
    assert cache.layers[2].latent.values.dtype == jnp.float8_e4m3fn
    ref = np.load(FIXTURES / "kimi_linear/reference.npz")
    logits = jax.jit(lambda m, i: m(i))(model, jnp.asarray(ref["input_ids"]))
    err = np.linalg.norm(np.asarray(logits) - ref["logits"]) / np.linalg.norm(ref["logits"])
    assert 1e-4 < err < 0.05  # bf16 weights + FP8 latents: close to the float32 reference, not equal


def test_fp8_weights_kept_in_fp8_when_asked(tmp_path):
    """projection: fp8 keeps DeepSeek's FP8 blocks as they are; bf16 tensors are block-quantized on load."""
    src = CheckpointFolder(FIXTURES / "deepseek_v32")
    tensors = {k: np.array(src[k]) for k in src}
    name = "model.layers.1.self_attn.q_b_proj.weight"
    w8 = np.clip(tensors[name] / 0.5, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    tensors[name], tensors[name + "_scale_inv"] = w8, np.array([[0.5]], np.float32)
    d = tmp_path / "ds_fp8"
    d.mkdir()
    shutil.copy(FIXTURES / "deepseek_v32/config.json", d)
    write_safetensors(d / "model.safetensors", tensors)
    q = tmp_path / "q.yaml"
    q.write_text("projection: {dtype: fp8}\n")
    model = from_pretrained(d, dtype=jnp.float32, quant=q, progress=False)
    layer = model.layers[1].self_attn.q_b_proj
    assert layer.kernel[...].dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(layer.kernel[...]).view(np.uint8), w8.T.view(np.uint8))
    np.testing.assert_array_equal(layer.kernel_scale_inv[...], [[0.5]])
    # A bf16/f32 tensor of the same checkpoint was quantized on load to within E4M3 precision.
    o = model.layers[1].self_attn.o_proj
    ref = tensors["model.layers.1.self_attn.o_proj.weight"].T
    deq = np.asarray(o.dense_kernel(jnp.float32))
    assert o.kernel[...].dtype == jnp.float8_e4m3fn and np.abs(deq - ref).max() <= np.abs(ref).max() / 16
    # ... and the FP8 model round-trips through our own format bit for bit.
    save_pretrained(model, tmp_path / "fp8_hybrid")
    back = from_pretrained(tmp_path / "fp8_hybrid", dtype=jnp.float32, quant=q, progress=False)
    for a, b in zip(
        jax.tree_util.tree_leaves(nnx.state(model)), jax.tree_util.tree_leaves(nnx.state(back)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    ids = jnp.asarray(np.load(FIXTURES / "deepseek_v32/reference.npz")["input_ids"])
    assert np.isfinite(np.asarray(jax.jit(lambda m, i: m(i))(model, ids))).all()


def test_convert_keeps_fp8_projections_and_restores_them(tmp_path):
    q = tmp_path / "q.yaml"
    q.write_text("projection: {dtype: fp8}\n")
    from hybrid_jax.cli import main

    assert main(["convert", str(FIXTURES / "kimi_linear"), str(tmp_path / "o"), "--quant", str(q)]) == 0
    model = from_pretrained(tmp_path / "o")
    assert model.layers[2].self_attn.kv_b_proj.kernel[...].dtype == jnp.float8_e4m3fn
    direct = from_pretrained(FIXTURES / "kimi_linear", quant=q, progress=False)
    for a, b in zip(
        jax.tree_util.tree_leaves(nnx.state(model)), jax.tree_util.tree_leaves(nnx.state(direct)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    q.write_text("projection: {dtype: bf16}\n")
    with pytest.raises(CheckpointError, match="converted with projection dtype 'fp8'"):
        from_pretrained(tmp_path / "o", quant=q)
