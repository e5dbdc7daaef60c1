"""Day-0 loading: parity with transformers on the committed fixtures, formats, conversion and bad input."""

import json
import os
import shutil
import struct
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
from tests.conftest import xla_flags

FIXTURES = Path(__file__).parent / "fixtures"
GEN = jax.jit(generate, static_argnames=("max_new_tokens",))


@pytest.fixture(
    scope="module", params=["kimi_linear", "deepseek_v32", "glm5_next_a", "glm5_next_b", "qwen3_next", "qwen3_5_moe"]
)
def fixture(request):
    d = FIXTURES / request.param
    return d, from_pretrained(d, dtype=jnp.float32, progress=False), np.load(d / "reference.npz")


def test_logits_match_transformers(fixture):
    d, model, ref = fixture
    logits = np.asarray(jax.jit(lambda m, i: m(i))(model, jnp.asarray(ref["input_ids"])))
    max_rel = np.abs(logits - ref["logits"]).max() / np.abs(ref["logits"]).max()
    # glm5_next, qwen: 1e-5, tight enough that an eps of 1e-6 for 1e-5 in one norm shows (measured 4.7e-7 / 5.8e-7 /
    # 6.8e-7 / 7.7e-7)
    assert max_rel <= (1e-5 if d.name.startswith(("glm5", "qwen")) else 1e-4)


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
    for name in ("glm5_next_a", "glm5_next_b"):
        glm = config_from_hf(json.loads((FIXTURES / name / "config.json").read_text()))
        seq = np.load(FIXTURES / name / "reference.npz")["input_ids"].shape[1]
        p = glm.index_kpool
        assert p > 1 and seq % p and seq % 64 and glm.index_topk // p < seq // p  # pools the Top-K must choose among
        assert glm.hc_mult > 1 and glm.swiglu_limit is not None and glm.qk_rope_head_dim == 0
        assert {"dense", "moe"} <= set(glm.mlp_types) and {"linear", "sparse"} <= set(glm.layer_types)
    assert any(config_from_hf(json.loads((FIXTURES / "glm5_next_a/config.json").read_text())).shares_indexer(i)
               for i in range(6))  # fmt: skip
    for name in ("qwen3_next", "qwen3_5_moe"):
        qwen = config_from_hf(json.loads((FIXTURES / name / "config.json").read_text()))
        seq = np.load(FIXTURES / name / "reference.npz")["input_ids"].shape[1]
        assert qwen.kda_num_heads % qwen.kda_k_heads == 0 and qwen.kda_num_heads > qwen.kda_k_heads > 1
        assert qwen.kda_v_dim != qwen.kda_head_dim and qwen.hidden_size % 2 and seq % 64
        assert 0 < qwen.attn_rope_dim < qwen.attn_head_dim and qwen.attn_num_kv_heads < qwen.num_heads
        assert {"linear", "attention"} <= set(qwen.layer_types) and "moe" in qwen.mlp_types
    qwen_next = config_from_hf(json.loads((FIXTURES / "qwen3_next/config.json").read_text()))
    assert "dense" in qwen_next.mlp_types  # mlp_only_layers; qwen3_5_moe has no dense layer
    assert sum(f.stat().st_size for f in FIXTURES.rglob("*") if f.is_file()) < 7e6  # ~1 MB per model family


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
        ({"model_type": "llama"}, r"unknown model_type 'llama'; supported: kimi_linear, deepseek_v32, glm5_next"),
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
    with pytest.raises(CheckpointError, match=r"model.safetensors: the file is shorter than its header promises"):
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


def test_fp8_scales_apply_per_128_block_with_partial_edges(tmp_path):
    """A [300, 200] E4M3 weight with a 3 x 2 scale grid (the last row and column blocks partial): each element is
    scaled by its own block's scale, and a transposed grid is refused naming the tensor."""
    from checkpoints.hf import _weight

    rng = np.random.default_rng(0)
    w8 = rng.uniform(-4, 4, (300, 200)).astype(ml_dtypes.float8_e4m3fn)
    scale = np.array([[1.0, 2.0], [4.0, 8.0], [16.0, 32.0]], np.float32)
    tensors = {"a.weight": w8, "a.weight_scale_inv": scale, "b.weight": w8, "b.weight_scale_inv": scale.T.copy()}
    write_safetensors(tmp_path / "model.safetensors", tensors)
    reader = CheckpointFolder(tmp_path)
    got = _weight(reader, "a.weight")
    v = w8.astype(np.float32)
    for (r0, r1, i), (c0, c1, j) in [
        ((0, 128, 0), (0, 128, 0)),
        ((128, 256, 1), (128, 200, 1)),
        ((256, 300, 2), (0, 128, 0)),
    ]:
        np.testing.assert_array_equal(got[r0:r1, c0:c1], v[r0:r1, c0:c1] * scale[i, j])
    np.testing.assert_array_equal(got[256:, 128:], v[256:, 128:] * 32.0)
    with pytest.raises(CheckpointError, match=r"b.weight_scale_inv.*\(2, 3\).*\(300, 200\)"):
        _weight(reader, "b.weight")


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
        "XLA_FLAGS": xla_flags(8),
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


# ---------------------------------------------------------------- a checkpoint folder is never trusted


def _read_raw(path: Path) -> tuple[dict, bytes]:
    b = path.read_bytes()
    (n,) = struct.unpack("<Q", b[:8])
    return json.loads(b[8 : 8 + n]), b[8 + n :]


def _write_raw(path: Path, header: dict | bytes, data: bytes) -> None:
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


A, B = "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"  # both [64] F32


def test_overlapping_tensors_are_refused(tmp_path):
    """The issue's alteration: B's data_offsets point at A's bytes. Both loaded as equal weights before."""
    d = _copy_fixture(tmp_path)
    header, data = _read_raw(d / "model.safetensors")
    header[B]["data_offsets"] = header[A]["data_offsets"]
    _write_raw(d / "model.safetensors", header, data)
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor '.*layernorm.weight'.*overlap.*layernorm"):
        from_pretrained(d, progress=False)


def test_overlap_is_refused_even_when_the_data_is_covered_exactly(tmp_path):
    """B's bytes removed and every later offset shifted: no gap, no trailing bytes, only the overlap is wrong."""
    d = _copy_fixture(tmp_path)
    header, data = _read_raw(d / "model.safetensors")
    lo, hi = header[B]["data_offsets"]
    data = data[:lo] + data[hi:]
    for name, info in header.items():
        if name != "__metadata__" and info["data_offsets"][0] >= hi:
            info["data_offsets"] = [o - (hi - lo) for o in info["data_offsets"]]
    header[B]["data_offsets"] = header[A]["data_offsets"]
    _write_raw(d / "model.safetensors", header, data)
    with pytest.raises(CheckpointError, match=rf"model.safetensors: tensor '{B}' data_offsets \[155648, 155904\] "):
        SafetensorsFile(d / "model.safetensors")


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda h, d: (h, d + b"\0" * 8), r"8 bytes after the last tensor"),
        (lambda h, d: ({**h, B: {**h[B], "data_offsets": [155904 + 8, 156160 + 8]}}, d), r"'.*post_attention.*' data_"),
        (lambda h, d: ({**h, A: {**h[A], "dtype": "F33"}}, d), r"'.*input_layernorm.weight' dtype 'F33' is not a "),
        (lambda h, d: ({**h, A: {**h[A], "dtype": "f32"}}, d), r"dtype 'f32' is not a safetensors dtype"),
        (lambda h, d: ({**h, A: {**h[A], "dtype": "C64"}}, d), r"dtype 'C64'.*not supported"),
        (
            lambda h, d: ({**h, A: {**h[A], "shape": [65]}}, d),
            r"'.*input_layernorm.weight'.*\(65,\) F32 needs 260 bytes",
        ),
        (lambda h, d: ({**h, A: {**h[A], "shape": [64.0]}}, d), r"'.*input_layernorm.weight' shape"),
        (lambda h, d: ({**h, A: {**h[A], "shape": [-64]}}, d), r"'.*input_layernorm.weight' shape"),
        (lambda h, d: ({**h, A: {**h[A], "data_offsets": [True, 256]}}, d), r"'.*input_layernorm.weight' data_offsets"),
        (lambda h, d: ({**h, A: {**h[A], "data_offsets": [0]}}, d), r"'.*input_layernorm.weight' data_offsets"),
        (lambda h, d: ({**h, "__metadata__": {"format": 1}}, d), r"__metadata__"),
        (lambda h, d: (json.dumps(h).encode().replace(b'"model.norm.weight"', f'"{A}"'.encode()), d), "duplicate"),
        (lambda h, d: (b" " + json.dumps(h).encode(), d), r"header does not start with '\{'"),
        (lambda h, d: (json.dumps(h).encode() + b"\0", d), r"header"),
    ],
)
def test_every_header_field_is_validated(tmp_path, edit, match):
    d = _copy_fixture(tmp_path)
    header, data = _read_raw(d / "model.safetensors")
    _write_raw(d / "model.safetensors", *edit(header, data))
    with pytest.raises(CheckpointError, match=r"model.safetensors: .*" + match):
        from_pretrained(d, progress=False)


def test_header_length_is_bounded(tmp_path):
    path = tmp_path / "big.safetensors"
    path.write_bytes(struct.pack("<Q", 100_000_001) + b"{}" + b" " * 6)
    with pytest.raises(CheckpointError, match=r"big.safetensors: header length 100000001 .*100000000"):
        SafetensorsFile(path)


def test_tensors_listed_in_any_order_with_empty_ones_load(tmp_path):
    """What the spec allows: entries in any JSON order, zero-size tensors at any boundary, metadata."""
    header = {
        "b": {"dtype": "BF16", "shape": [2], "data_offsets": [8, 12], "other": "ignored, as the library does"},
        "e": {"dtype": "F32", "shape": [0, 3], "data_offsets": [12, 12]},
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F8_E8M0", "shape": [2, 4], "data_offsets": [0, 8]},
    }
    _write_raw(tmp_path / "x.safetensors", header, bytes(range(12)))
    f = SafetensorsFile(tmp_path / "x.safetensors")
    assert f.get("a").dtype == ml_dtypes.float8_e8m0fnu and f.get("a").shape == (2, 4)
    assert f.get("b").view(np.uint8).tolist() == [8, 9, 10, 11] and f.get("e").shape == (0, 3)


def _sharded(tmp_path: Path, name: str = "kimi_linear") -> Path:
    """The fixture as one shard plus model.safetensors.index.json."""
    d = _copy_fixture(tmp_path, name)
    shard = "model-00001-of-00001.safetensors"
    (d / "model.safetensors").rename(d / shard)
    header, _ = _read_raw(d / shard)
    weight_map = {k: shard for k in header if k != "__metadata__"}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


def _point_index_at(d: Path, target: str, only: str | None = None) -> None:
    index = json.loads((d / "model.safetensors.index.json").read_text())
    for k in index["weight_map"]:
        if only is None or k == only:
            index["weight_map"][k] = target
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("target", ["../outside.safetensors", "ABS", "sub/../../outside.safetensors", "link"])
def test_an_index_never_reaches_outside_the_folder(tmp_path, target):
    """A valid copy of the weights sits next to the folder: naming it (relative, absolute, or through a
    symlink in the folder) loaded it before."""
    d = _sharded(tmp_path)
    shutil.copy(d / "model-00001-of-00001.safetensors", tmp_path / "outside.safetensors")
    if target == "ABS":
        target = str(tmp_path / "outside.safetensors")
    elif target == "link":
        (d / "link.safetensors").symlink_to(tmp_path / "outside.safetensors")
        target = "link.safetensors"
    (d / "sub").mkdir()
    _point_index_at(d, target, only=A)
    with pytest.raises(CheckpointError, match=rf"model.safetensors.index.json: weight_map\['{A}'\] = .*outside"):
        from_pretrained(d, progress=False)


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_a_symlink_out_of_the_folder_is_refused(tmp_path, name):
    d = _copy_fixture(tmp_path)
    (d / name).rename(tmp_path / name)
    (d / name).symlink_to(tmp_path / name)
    with pytest.raises(CheckpointError, match=rf"{name} .*outside the checkpoint folder"):
        from_pretrained(d, progress=False)


def test_symlinks_inside_the_folder_and_a_symlinked_folder_load(tmp_path):
    d = _sharded(tmp_path)
    (d / "blobs").mkdir()
    (d / "model-00001-of-00001.safetensors").rename(d / "blobs" / "abc")
    (d / "model-00001-of-00001.safetensors").symlink_to(Path("blobs") / "abc")
    (tmp_path / "alias").symlink_to(d)
    model = from_pretrained(tmp_path / "alias", dtype=jnp.float32, progress=False)
    ref = from_pretrained(FIXTURES / "kimi_linear", dtype=jnp.float32, progress=False)
    for a, b in zip(
        jax.tree_util.tree_leaves(nnx.state(model)), jax.tree_util.tree_leaves(nnx.state(ref)), strict=True
    ):
        np.testing.assert_array_equal(a, b)


def test_hugging_face_cache_snapshot_links_to_its_blobs_load(tmp_path):
    """`snapshot_download` without local_dir: snapshots/<rev>/<file> -> ../../blobs/<hash>."""
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    for f in ("config.json", "model.safetensors"):
        shutil.copy(FIXTURES / "kimi_linear" / f, repo / "blobs" / f"hash-{f}")
        (snap / f).symlink_to(Path("../../blobs") / f"hash-{f}")
    assert isinstance(from_pretrained(snap, dtype=jnp.float32, progress=False), HybridLM)
    (snap / "model.safetensors").unlink()
    (snap / "model.safetensors").symlink_to(Path("../../other"))
    (repo / "other").write_bytes((repo / "blobs" / "hash-model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        from_pretrained(snap, progress=False)


@pytest.mark.parametrize(
    "index,match",
    [
        ("{not json", r"index.json: invalid JSON"),
        ('{"metadata": {}}', r"index.json: no 'weight_map'"),
        ('{"weight_map": ["a"]}', r"index.json: weight_map"),
        ('{"weight_map": {"model.norm.weight": 3}}', r"index.json: weight_map\['model.norm.weight'\] = 3"),
        ('{"weight_map": {"model.norm.weight": ""}}', r"index.json: weight_map\['model.norm.weight'\] = ''"),
        ('{"weight_map": {"model.norm.weight": "nul\\u0000.safetensors"}}', r"weight_map\['model.norm.weight'\]"),
        ('{"weight_map": {"model.norm.weight": "missing.safetensors"}}', r"weight_map\['model.norm.weight'\].*missing"),
        ('{"weight_map": {"model.norm.weight": "."}}', r"weight_map\['model.norm.weight'\] = '.'.* not a file"),
    ],
)
def test_a_malformed_index_is_named(tmp_path, index, match):
    d = _sharded(tmp_path)
    (d / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointError, match=match):
        from_pretrained(d, progress=False)


def test_index_and_shards_must_agree(tmp_path):
    d = _sharded(tmp_path)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.9.foo"] = "model-00001-of-00001.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"weight_map\['model.layers.9.foo'\].*not in that file"):
        from_pretrained(d, progress=False)


def test_a_tensor_in_two_shards_is_refused(tmp_path):
    d = _sharded(tmp_path)
    write_safetensors(d / "model-extra.safetensors", {"model.norm.weight": np.zeros(64, np.float32)})
    _point_index_at(d, "model-extra.safetensors", only="model.norm.weight")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.embed_tokens.weight"] = "model-00001-of-00001.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' is in both .*model-00001.*model-extra"):
        from_pretrained(d, progress=False)


def test_fewer_layers_in_config_than_in_the_checkpoint_is_refused(tmp_path):
    """Layers past num_layers were skipped as if they were DeepSeek's MTP module, for every model type."""
    d = tmp_path / "tiny"
    save_pretrained(
        HybridLM(
            HybridConfig.tiny().replace(num_layers=2, layer_types=("linear", "full"), mlp_types=("dense", "moe")),
            rngs=nnx.Rngs(0),
        ),
        d,
    )
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(num_layers=1, layer_types=["linear"], mlp_types=["dense"])
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*model.layers.1"):
        from_pretrained(d, progress=False)


def test_an_integer_tensor_for_a_float_parameter_is_refused(tmp_path):
    d = _copy_fixture(tmp_path)
    header, data = _read_raw(d / "model.safetensors")
    header[A]["dtype"] = "I32"
    _write_raw(d / "model.safetensors", header, data)
    with pytest.raises(CheckpointError, match=rf"'{A}' in .*/model.safetensors: dtype int32 .*floating"):
        from_pretrained(d, progress=False)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"hidden_size": 64.5}, r"config.json: .*hidden_size"),
        ({"hidden_size": "64"}, r"config.json: .*hidden_size"),
        ({"linear_attn_config": 3}, r"config.json: .*linear_attn_config"),
        (
            {"layer_types": None, "linear_attn_config": {"full_attn_layers": [0], "kda_layers": [1, 2, 4, 5]}},
            r"config.json: linear_attn_config.*full_attn_layers.*0",
        ),
        (
            {"layer_types": None, "linear_attn_config": {"full_attn_layers": [3, 9], "kda_layers": [1, 2, 4, 5]}},
            r"config.json: linear_attn_config.*full_attn_layers.*9",
        ),
        (
            {"layer_types": None, "linear_attn_config": {"full_attn_layers": [3], "kda_layers": [1, 2, 3, 4, 5]}},
            r"config.json: linear_attn_config.*layer 3 .*both",
        ),
    ],
)
def test_a_malformed_config_is_named(tmp_path, change, match):
    d = _copy_fixture(tmp_path)
    cfg = {**json.loads((d / "config.json").read_text()), **change}
    (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    with pytest.raises(CheckpointError, match=match):
        from_pretrained(d, progress=False)


@pytest.fixture(scope="module")
def orbax_folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("orbax") / "o"
    return convert(FIXTURES / "kimi_linear", out, dtype=jnp.float32, progress=False)


def _orbax_variant(orbax_folder, tmp_path, edit_state=None, edit_config=None) -> Path:
    import orbax.checkpoint as ocp

    d = tmp_path / "variant"
    shutil.copytree(orbax_folder, d, ignore=shutil.ignore_patterns("state") if edit_state else None)
    if edit_state:
        with ocp.StandardCheckpointer() as ckpt:
            state = jax.tree_util.tree_map(np.asarray, ckpt.restore(orbax_folder / "state"))
        edit_state(state)
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(d / "state", state)
            ckpt.wait_until_finished()
    if edit_config:
        cfg = json.loads((d / "config.json").read_text())
        edit_config(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize(
    "edit_state,edit_config,match",
    [
        (lambda s: s.pop("norm"), None, r"state: parameter norm.weight \(64,\) float32 is missing"),
        (
            lambda s: s["norm"].update(weight=np.ones(65, np.float32)),
            None,
            r"norm.weight has shape \(65,\), the model's is \(64,\)",
        ),
        (lambda s: s["norm"].update(weight=np.ones(64, np.int32)), None, r"norm.weight.*int32.*float"),
        (lambda s: s.update(extra={"x": np.ones(3)}), None, r"state: unexpected array extra.x"),
        (
            None,
            lambda c: c.update(hidden_size=32),
            r"embed_tokens.embedding has shape \(160, 64\), the model's is \(160, 32\); .*written for another config",
        ),
        (
            None,
            lambda c: c.update(num_layers=4, layer_types=c["layer_types"][:4], mlp_types=c["mlp_types"][:4]),
            r"unexpected array layers.4",
        ),
    ],
)
def test_orbax_restore_names_what_does_not_match(orbax_folder, tmp_path, edit_state, edit_config, match):
    d = _orbax_variant(orbax_folder, tmp_path, edit_state, edit_config)
    with pytest.raises(CheckpointError, match=match) as e:
        from_pretrained(d, dtype=jnp.float32)
    assert str(d) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "marker,match",
    [
        ("{oops", r"hybrid_jax_checkpoint.json: invalid JSON"),
        ('{"format": "orbax"}', r"hybrid_jax_checkpoint.json: .*dtype"),
        ('{"format": "orbax", "dtype": "float99"}', r"hybrid_jax_checkpoint.json: dtype 'float99'"),
        ('{"format": "zip", "dtype": "float32"}', r"hybrid_jax_checkpoint.json: format 'zip'"),
    ],
)
def test_orbax_marker_is_validated(orbax_folder, tmp_path, marker, match):
    d = _orbax_variant(orbax_folder, tmp_path)
    (d / "hybrid_jax_checkpoint.json").write_text(marker)
    with pytest.raises(CheckpointError, match=match):
        from_pretrained(d)


def test_orbax_state_may_not_link_outside(orbax_folder, tmp_path):
    d = _orbax_variant(orbax_folder, tmp_path)
    shutil.move(d / "state", tmp_path / "state")
    os.symlink(tmp_path / "state", d / "state")
    with pytest.raises(CheckpointError, match=r"state .*outside the checkpoint folder"):
        from_pretrained(d)


@pytest.mark.slow
def test_auto_dtype_is_the_checkpoints_own(tmp_path):
    """dtype="auto" (the default): config.json's dtype, else the tensors'; a float32 checkpoint loads float32
    (and so matches transformers without asking), a bf16 one bf16; convert keeps it; restoring a bf16 copy at
    float32 warns that the precision is not there."""
    f32 = from_pretrained(FIXTURES / "kimi_linear", progress=False)  # config.json says float32
    assert f32.dtypes.compute == jnp.float32 and f32.dtypes.param == jnp.float32
    no_field = tmp_path / "no_dtype_field"
    shutil.copytree(FIXTURES / "kimi_linear", no_field)
    raw = json.loads((no_field / "config.json").read_text())
    raw.pop("dtype", None), raw.pop("torch_dtype", None)
    (no_field / "config.json").write_text(json.dumps(raw))
    assert from_pretrained(no_field, progress=False).dtypes.compute == jnp.float32  # from the F32 tensors
    raw["torch_dtype"] = "bfloat16"  # the older field name, as released checkpoints write it
    (no_field / "config.json").write_text(json.dumps(raw))
    assert from_pretrained(no_field, progress=False).dtypes.compute == jnp.bfloat16
    bf16 = tmp_path / "bf16"
    save_pretrained(HybridLM(HybridConfig.tiny(), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), bf16)
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    assert from_pretrained(bf16, progress=False).dtypes.compute == jnp.bfloat16
    kept = convert(FIXTURES / "kimi_linear", tmp_path / "orbax_f32", progress=False)
    restored = from_pretrained(kept)
    assert restored.dtypes.compute == jnp.float32
    leaves = [v for v in jax.tree.leaves(nnx.state(restored)) if jnp.issubdtype(v.dtype, jnp.floating)]
    assert {str(v.dtype) for v in leaves} == {"float32"}
    low = convert(FIXTURES / "kimi_linear", tmp_path / "orbax_bf16", dtype="bfloat16", progress=False)
    with pytest.warns(UserWarning, match="holds bfloat16 weights; loading them as float32 adds no precision"):
        from_pretrained(low, dtype="float32")
    with pytest.raises(ValueError, match="dtype='f33' is not a dtype name"):
        from_pretrained(FIXTURES / "kimi_linear", dtype="f33", progress=False)


def test_save_pretrained_copies_the_tokenizer_files_it_loaded_with(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "kimi_linear", src)
    (src / "tokenizer_config.json").write_text('{"model_max_length": 77}')
    (src / "generation_config.json").write_text('{"do_sample": false}')
    model = from_pretrained(src, progress=False)
    save_pretrained(model, tmp_path / "out")
    for f in ("tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "out" / f).read_text() == (src / f).read_text()
    save_pretrained(HybridLM(HybridConfig.tiny(), rngs=nnx.Rngs(0)), tmp_path / "fresh")  # built, not loaded
    assert not (tmp_path / "fresh" / "tokenizer_config.json").exists()
