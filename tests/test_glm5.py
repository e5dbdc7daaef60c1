"""GLM-5.3-Flash (`glm5_next`) pieces: the KPool indexer, shared indexer layers, hyper-connections, the preset.

Parity with transformers is in tests/test_checkpoints.py (fixtures glm5_next_a / glm5_next_b)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_jax import HybridConfig, HybridLM
from hybrid_jax.cache import StepInfo
from hybrid_jax.layers.common import DTypes
from hybrid_jax.layers.hyper import HyperConnection
from hybrid_jax.layers.mla import LightningIndexer
from hybrid_jax.quant.config import QuantConfig
from pallas_kernels.indexer import expand_pools, kpool_compress
from tests.conftest import prefill_then_decode, random_ids, rel_err


def glm5_tiny(**changes) -> HybridConfig:
    """Every glm5_next feature at toy size: KDA with the safe gate, NoPE MLA (R = 0), a KPool indexer (pools of
    4), a shared indexer layer, clamped SwiGLU, grouped MoE, 4 hyper-connection streams.

    Sinkhorn runs 3 passes, not the released 20: the passes are unrolled, each adds two reductions to every
    hyper-connection, and 3 instead of 20 take 42% off the whole model's CPU compile (the tests' time). These tests
    compare our own paths with each other, which any pass count exercises alike; the count itself is checked
    by `test_sinkhorn_runs_its_iterations_as_written` (1, 3, 20) and against transformers by the glm5_next_a
    fixture (20) and glm5_next_b (7)."""
    cfg = HybridConfig(
        vocab_size=160, hidden_size=64, num_layers=6,
        layer_types=("linear", "linear", "sparse", "sparse", "linear", "sparse"),
        mlp_types=("dense",) + ("moe",) * 5,
        kda_num_heads=2, kda_head_dim=16, kda_decay_rank=16, kda_output_gate_rank=16, kda_gate_lower_bound=-5.0,
        kda_chunk_size=8,
        num_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=0, v_head_dim=16,
        mla_use_rope=False, mla_norm_eps=1e-5,
        index_num_heads=4, index_head_dim=32, index_topk=8, index_kpool=4,
        indexer_types=("full", "full", "full", "shared", "full", "full"),
        num_experts=8, num_experts_per_tok=2, num_shared_experts=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, moe_intermediate_size=32, intermediate_size=96, swiglu_limit=0.5,
        hc_mult=4, hc_sinkhorn_iters=3, page_size=8, max_position_embeddings=256,
    )  # fmt: skip
    return cfg.replace(**changes)


def glm5_cut(**changes) -> HybridConfig:
    """`glm5_tiny` cut to one layer of each kind: KDA, a sparse layer with its own KPool indexer, a shared-indexer
    layer reading its selection; dense and MoE MLPs. For the tests whose time is compiling the whole model (CI
    time), where a second layer of a kind adds no path."""
    cut = dict(num_layers=3, layer_types=("linear", "sparse", "sparse"), mlp_types=("dense", "moe", "moe"),
               indexer_types=("full", "full", "shared"))  # fmt: skip
    return glm5_tiny(**{**cut, **changes})


# ------------------------------------------------------------------------------------------------ KPool pieces
def test_kpool_compress_is_a_per_channel_softmax_mean():
    k, g = (jax.random.normal(jax.random.key(i), (3, 5, 4, 7)) for i in (0, 1))
    ape = jax.random.normal(jax.random.key(2), (4, 7))
    got = np.asarray(kpool_compress(k, g, ape))
    kk, gg, aa = (np.asarray(a, np.float64) for a in (k, g, ape))
    want = np.zeros((3, 5, 7))
    for c in range(7):  # one softmax over the pool's 4 slots per channel
        w = np.exp(gg[..., c] + aa[:, c])
        want[..., c] = (w / w.sum(-1, keepdims=True) * kk[..., c]).sum(-1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="disagree"):
        kpool_compress(k, g, ape[:3])


def test_expand_pools_reads_whole_pools_and_the_own_tail():
    pools = jnp.array([[[2, 0, -1]]])  # pools 2 and 0 selected, one slot empty
    got = np.asarray(expand_pools(pools, jnp.array([[13]]), 4, tail=True))[0, 0]
    # pool 2 = 8..11, pool 0 = 0..3, empty = -1 x 4; the tail of a query at 13: its pool starts at 12 -> 12, 13
    np.testing.assert_array_equal(got, [8, 9, 10, 11, 0, 1, 2, 3, -1, -1, -1, -1, 12, 13, -1])
    at_boundary = np.asarray(expand_pools(pools, jnp.array([[15]]), 4, tail=True))[0, 0]
    np.testing.assert_array_equal(at_boundary[-3:], [-1, -1, -1])  # 15 completes pool 3: no tail
    assert expand_pools(pools, jnp.array([[13]]), 4, tail=False).shape == (1, 1, 12)


def _info(b, t, start=0, page_table=None, kv=None):
    pos = start + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return StepInfo(
        positions=pos, valid=jnp.ones((b, t), bool), n_new=jnp.full((b,), t, jnp.int32),
        page_table=jnp.arange(b, dtype=jnp.int32)[:, None] if page_table is None else page_table,
        kv_lengths=jnp.full((b,), start + t if kv is None else kv, jnp.int32), mode="prefill" if t > 1 else "decode",
    )  # fmt: skip


def _brute_force_selection(x, layer: LightningIndexer, cfg: HybridConfig) -> list:
    """The KPool selection from its definition, in numpy float64, per (row, query): a set of positions."""
    p, k_top = cfg.index_kpool, cfg.index_topk // cfg.index_kpool
    b, t, _ = x.shape
    q = np.asarray(layer.wq_b(x), np.float64).reshape(b, t, cfg.index_num_heads, cfg.index_head_dim)
    k = np.asarray(layer.k_norm(layer.wk(x)), np.float64)
    g = np.asarray(layer.index_kpool_compress_gate(x), np.float64) + 0.0
    ape = np.asarray(layer.index_kpool_compress_ape[...], np.float64)
    w = np.asarray(layer.weights_proj(x), np.float64) * cfg.index_num_heads**-0.5
    out = []
    for r in range(b):
        rows = []
        for i in range(t):
            n_pools = (i + 1) // p
            keys = []
            for j in range(n_pools):
                logit = g[r, j * p : (j + 1) * p] + ape
                e = np.exp(logit - logit.max(0))
                keys.append((e / e.sum(0) * k[r, j * p : (j + 1) * p]).sum(0))
            scores = [float((w[r, i] * np.maximum(q[r, i] @ key * cfg.index_head_dim**-0.5, 0)).sum()) for key in keys]
            order = np.argsort(scores)[::-1]
            if len(scores) > k_top:  # the fixture must not (nearly) tie at the cut
                gap = scores[order[k_top - 1]] - scores[order[k_top]]
                assert gap > 1e-3 * max(abs(v) for v in scores), (r, i, gap)
            chosen = {j * p + s for j in order[:k_top] for s in range(p)}
            rows.append(chosen | set(range(n_pools * p, i + 1)))
        out.append(rows)
    return out


def test_kpool_decode_selection_equals_prefill_selection_and_the_definition():
    """Token by token through the cache (pooled keys + tail), in uneven chunks, and in one call: the same sets,
    and the sets the definition gives."""
    cfg = glm5_tiny()
    layer = LightningIndexer(cfg, DTypes(jnp.float32, jnp.float32), QuantConfig(), rngs=nnx.Rngs(3))
    b, t, g = 2, 23, 8
    x = jax.random.normal(jax.random.key(4), (b, t, cfg.hidden_size))
    c_q = jax.random.normal(jax.random.key(5), (b, t, cfg.q_lora_rank))

    def as_sets(idx):
        return [[set(np.asarray(idx)[r, i].tolist()) - {-1} for i in range(idx.shape[1])] for r in range(b)]

    call = jax.jit(lambda layer, *args: layer(*args))  # one compile per chunk length (CI time: not op by op)
    one, _, _ = call(layer, x, c_q, _info(b, t), None)
    assert one.shape == (b, t, cfg.index_topk + cfg.index_kpool - 1)
    table = jnp.arange(b * 4, dtype=jnp.int32).reshape(b, 4)  # 4 pages of 8 slots per row
    for chunks in ([1] * t, [6, 1, 9, 7]):
        pool, tail = layer.init_state(b * 4, g, b, jnp.float32)
        got, start = [], 0
        for n in chunks:
            info = _info(b, n, start=start, page_table=table)
            idx, pool, tail = call(layer, x[:, start : start + n], c_q[:, start : start + n], info, pool, tail)
            got.append(idx)
            start += n
        assert as_sets(jnp.concatenate(got, axis=1)) == as_sets(one), chunks
    q_in = layer.wq_b
    layer.wq_b = lambda _x: q_in(c_q)  # the brute force projects c_q through wq_b, like the layer
    want = _brute_force_selection(x, layer, cfg)
    layer.wq_b = q_in
    assert as_sets(one) == want


def test_hyper_connection_mixer_is_doubly_stochastic_and_mixes_as_written():
    hc = HyperConnection(8, 3, iters=20, eps=1e-6, norm_eps=1e-5, rngs=nnx.Rngs(0))
    h = jax.random.normal(jax.random.key(1), (2, 5, 3, 8))
    pre, post, comb = (np.asarray(a) for a in hc.weights(h))
    np.testing.assert_allclose(comb.sum(-1), 1.0, atol=1e-3)
    np.testing.assert_allclose(comb.sum(-2), 1.0, atol=1e-5)
    assert (pre > 0).all() and (pre < 1 + 1e-5).all() and (post > 0).all() and (post < 2).all()
    out, _ = hc(h, lambda u: (2.0 * u, None))
    hh = np.asarray(h)
    u = (pre[..., None] * hh).sum(-2)
    want = post[..., None] * (2.0 * u)[..., None, :] + np.einsum("btji,btjd->btid", comb, hh)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)


def test_sinkhorn_runs_its_iterations_as_written():
    """M: the column pass, then `iters` - 1 row-and-column passes (numpy, float64 against float32)."""
    h = jax.random.normal(jax.random.key(2), (2, 3, 4, 8))
    for iters in (1, 3, 20):
        hc = HyperConnection(8, 4, iters=iters, eps=1e-3, norm_eps=1e-5, rngs=nnx.Rngs(iters))
        _, _, comb = hc.weights(h)
        flat = np.asarray(h, np.float64).reshape(2, 3, -1)
        flat = flat / np.sqrt((flat * flat).mean(-1, keepdims=True) + 1e-5)
        mix = flat @ np.asarray(hc.fn[...], np.float64)
        logits = mix[..., 8:].reshape(2, 3, 4, 4) * float(hc.scale[...][2]) + np.asarray(hc.base[...][8:]).reshape(4, 4)
        m = np.exp(logits - logits.max(-1, keepdims=True))
        m = m / m.sum(-1, keepdims=True) + 1e-3
        m = m / (m.sum(-2, keepdims=True) + 1e-3)
        for _ in range(iters - 1):
            m = m / (m.sum(-1, keepdims=True) + 1e-3)
            m = m / (m.sum(-2, keepdims=True) + 1e-3)
        np.testing.assert_allclose(np.asarray(comb), m, rtol=2e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------ the model
@pytest.mark.slow
def test_glm5_decode_and_chunked_prefill_reproduce_the_full_forward(jitted):
    cfg = glm5_cut()  # layers: KDA, sparse with its own indexer, shared-indexer sparse
    model = HybridLM(cfg, rngs=nnx.Rngs(0))
    ids = random_ids(11, (2, 29), cfg.vocab_size)  # 29: a multiple of neither the pool (4) nor the chunk (8)
    full = jitted["forward"](model, ids)
    stepped, cache = prefill_then_decode(model, ids, jitted, 13, 40)
    assert rel_err(stepped, full) < 1e-4
    assert cache.layers[2].index_k is None and cache.layers[2].index_tail is None  # the shared layer keeps none
    assert cache.layers[1].index_tail.shape == (2, 4, 2 * cfg.index_head_dim)


@pytest.mark.slow
def test_glm5_ragged_chunks_inactive_and_overflow_rows(jitted):
    """Rows of different lengths prefilled in two right-padded chunks, then decode steps with one row inactive and,
    under jit, one that overflows its cache: every real token's logits equal the forward of its own row, and a row
    that takes no token keeps its KPool tail and pooled keys."""
    cfg = glm5_cut()  # layer 1: the sparse layer with its own indexer
    model = HybridLM(cfg, rngs=nnx.Rngs(0))
    ids = random_ids(13, (2, 16), cfg.vocab_size)
    ids = ids.at[1, 13].set(ids[1, 6])  # row 1's first decode step (ids[:, 13]) is its token 6: it holds ids[1, :7]
    # CI time: one shape per entry point (one compile each: chunks of 7, right-padded). The forward is causal:
    # row r's first logits are the forward of its own first tokens.
    full = jitted["forward"](model, ids)
    cache = model.init_cache(2, 16)
    first = jnp.array([7, 6])  # row 1 ends inside the first chunk
    lg1, cache = jitted["prefill"](model, ids[:, :7], cache, first)
    lg2, cache = jitted["prefill"](model, ids[:, 7:14], cache, jnp.array([6, 0]))  # the same shape: row 0 takes 6
    assert rel_err(lg1[0], full[0][:7]) < 1e-5 and rel_err(lg2[0, :6], full[0][7:13]) < 1e-5
    assert rel_err(lg1[1, :6], full[1][:6]) < 1e-5
    before = cache.layers[1]
    step = jax.jit(lambda m, i, c, a: m.decode_step(i, c, a))
    lg, cache = step(model, ids[:, 13], cache, jnp.array([True, True]))  # both rows step (row 1 at its position 6)
    assert rel_err(lg[0], full[0][13]) < 1e-5 and rel_err(lg[1], full[1][6]) < 1e-5
    lg_a, cache_a = step(model, ids[:, 14], cache, jnp.array([True, False]))
    assert rel_err(lg_a[0], full[0][14]) < 1e-5
    for name in ("index_tail",):
        np.testing.assert_array_equal(getattr(cache_a.layers[1], name)[1], getattr(cache.layers[1], name)[1])
    np.testing.assert_array_equal(cache_a.layers[1].index_k.values, cache.layers[1].index_k.values)  # no pool ends
    assert before.index_tail.shape == cache_a.layers[1].index_tail.shape
    # under jit a row that would overflow takes none of its tokens: NaN logits, its cache untouched. Row 0 holds
    # 15 of 16 tokens and is given 6; row 1 (7 tokens) takes its next 6.
    lgo, over = jitted["prefill"](model, ids[:, 7:14], cache_a, jnp.array([6, 6]))
    assert np.isnan(np.asarray(lgo[0])).all() and not np.isnan(np.asarray(lgo[1, :6])).any()
    assert np.asarray(over.lengths).tolist() == [15, 13]
    np.testing.assert_array_equal(over.layers[1].index_tail[0], cache_a.layers[1].index_tail[0])
    pages = np.asarray(over.page_table[0])
    np.testing.assert_array_equal(over.layers[1].latent.values[pages], cache_a.layers[1].latent.values[pages])
    assert rel_err(lgo[1, :6], full[1][7:13]) < 1e-5


def test_shared_layer_has_no_indexer_and_reads_the_full_layers_selection():
    cfg = glm5_tiny()
    model = nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0)))
    assert hasattr(model.layers[2].self_attn, "indexer") and not hasattr(model.layers[3].self_attn, "indexer")


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(index_topk=10), r"index_topk=10: must be a multiple of index_kpool=4"),
        (dict(index_kpool=0), r"index_kpool=0"),
        (dict(indexer_types=("full", "full", "shared", "full", "full", "full")), r"indexer_types\[2\]='shared'"),
        (dict(indexer_types=("full", "full", "full", "full", "full", "shared")), r"must follow a full sparse layer"),
        (dict(indexer_types=("full",) * 5), r"indexer_types=.*has 5 entries"),
        (dict(swiglu_limit=0.0), r"swiglu_limit=0.0"),
        (dict(swiglu_limit=float("inf")), r"swiglu_limit=inf"),
        (dict(hc_mult=0), r"hc_mult=0"),
        (dict(hc_mult=2, attn_res_block_size=2), r"hc_mult=2: hyper-connections and Block AttnRes"),
        (dict(index_rope_dim=8), r"index_rope_dim=8: pooled indexer keys"),
    ],
)
def test_bad_glm5_configs_name_the_field(changes, match):
    with pytest.raises(ValueError, match=match):
        glm5_tiny(**changes)


@pytest.mark.slow
def test_glm5_context_and_tensor_parallel_equal_one_device():
    """CP prefill (zigzag / sequential, pools straddling the shards and a 5-token cached head) and TP on 8 fake
    devices give the single-device logits, caches (pooled keys and tails included) and next decode step."""
    from tests.test_context_parallel import assert_cp_tp_equal_one_device

    # CI time: each mesh compiles the whole model
    setup = """
        from tests.test_glm5 import glm5_cut
        cfg = glm5_cut()
    """
    assert_cp_tp_equal_one_device(setup, dp_tp=True)


# ------------------------------------------------------------------------------------------------ loading
FIXTURE = __import__("pathlib").Path(__file__).parent / "fixtures" / "glm5_next_a"


_FORWARD = jax.jit(lambda m, i: m(i))  # one jitted function: models of the same structure share its compile


def _logits(model, ids):
    return np.asarray(_FORWARD(model, ids))


def test_glm5_loads_transformers_module_names_and_skips_the_vision_tower(tmp_path, caplog):
    """The fixture holds the released names (what save_pretrained writes); the same weights under transformers'
    module names (fused q|k|v conv, forget_gate.*, attn_hc.fn, fused experts) load to the same model, and the
    vision tower is skipped with one log line while any other stray tensor is still an error."""
    import json
    import logging
    import shutil

    from checkpoints import CheckpointError, from_pretrained
    from checkpoints.safetensors_io import CheckpointFolder, write_safetensors

    src = CheckpointFolder(FIXTURE)
    t = {k: np.array(src[k]) for k in src}
    assert any(k.startswith("model.visual.") for k in t)
    cfg = json.loads((FIXTURE / "config.json").read_text())["text_config"]
    e = cfg["n_routed_experts"]
    renamed = {}
    for k, v in t.items():
        k2 = k
        for a, b in (("self_attn.f_a_proj", "self_attn.forget_gate.f_a_proj"), ("self_attn.f_b_proj",
                     "self_attn.forget_gate.f_b_proj"), ("self_attn.dt_bias", "self_attn.forget_gate.dt_bias"),
                     ("self_attn.A_log", "self_attn.forget_gate.A_log"), ("hc_attn_", "attn_hc."),
                     ("hc_ffn_", "ffn_hc.")):  # fmt: skip
            k2 = k2.replace(a, b)
        renamed[k2] = v
    out = {}
    for k, v in renamed.items():
        if "_conv1d.weight" in k or ".experts." in k:
            continue
        out[k] = v
    for k in [k for k in renamed if k.endswith("q_conv1d.weight")]:
        base = k[: -len("q_conv1d.weight")]
        out[base + "conv1d.weight"] = np.concatenate([renamed[base + f"{c}_conv1d.weight"] for c in "qkv"], axis=0)
    for k in [k for k in renamed if k.endswith("experts.0.gate_proj.weight")]:
        base = k[: -len("0.gate_proj.weight")]
        gate = np.stack([renamed[f"{base}{i}.gate_proj.weight"] for i in range(e)])
        up = np.stack([renamed[f"{base}{i}.up_proj.weight"] for i in range(e)])
        out[base + "gate_up_proj"] = np.concatenate([gate, up], axis=1)
        out[base + "down_proj"] = np.stack([renamed[f"{base}{i}.down_proj.weight"] for i in range(e)])
    d = tmp_path / "modules"
    d.mkdir()
    shutil.copy(FIXTURE / "config.json", d)
    write_safetensors(d / "model.safetensors", out)
    ref = np.load(FIXTURE / "reference.npz")
    ids = jnp.asarray(ref["input_ids"])
    with caplog.at_level(logging.INFO, logger="hybrid_jax.checkpoints"):
        model = from_pretrained(d, dtype=jnp.float32, progress=False)
    assert sum("skipping the vision tower" in r.message for r in caplog.records) == 1
    got = _logits(model, ids)
    assert np.abs(got - ref["logits"]).max() / np.abs(ref["logits"]).max() <= 1e-5
    write_safetensors(d / "model.safetensors", {**out, "model.language_model.layers.0.extra": np.zeros(2, np.float32)})
    with pytest.raises(CheckpointError, match=r"1 unexpected tensor\(s\).*layers.0.extra"):
        from_pretrained(d, dtype=jnp.float32, progress=False)


def _fp8_blocks(w: np.ndarray, block: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """[out, in] float32 -> (E4M3 values, float32 scale per block x block tile), as FP8 releases store them."""
    import ml_dtypes

    o, i = w.shape
    bo, bi = -(-o // block), -(-i // block)
    padded = np.zeros((bo * block, bi * block), np.float32)
    padded[:o, :i] = w
    amax = np.abs(padded.reshape(bo, block, bi, block)).max(axis=(1, 3))
    scale = np.maximum(amax / 448.0, 1e-12).astype(np.float32)
    full = np.repeat(np.repeat(scale, block, 0), block, 1)[:o, :i]
    return (w / full).astype(ml_dtypes.float8_e4m3fn), scale


def test_glm5_fp8_block_scaled_weights_load_as_their_dequantized_values(tmp_path):
    """A release in DeepSeek's FP8 format (E4M3 projection and per-expert weights, `weight_scale_inv` per 128 x 128
    block) loads as the dequantized weights: the same logits as a float32 folder holding those values, which
    differ from the unquantized fixture's (the format is lossy)."""
    import json
    import shutil

    from checkpoints import from_pretrained
    from checkpoints.safetensors_io import CheckpointFolder, write_safetensors

    src = CheckpointFolder(FIXTURE)
    t = {k: np.array(src[k]) for k in src}
    fp8, dense = dict(t), dict(t)
    quantized = 0
    for k, v in t.items():
        linear = k.endswith(("proj.weight", "indexer.wq_b.weight", "indexer.wk.weight"))  # not norms, router, hc
        if k.startswith("model.language_model.layers.") and linear and v.ndim == 2:
            w8, scale = _fp8_blocks(v.astype(np.float32))
            fp8[k], fp8[k + "_scale_inv"] = w8, scale
            full = np.repeat(np.repeat(scale, 128, 0), 128, 1)[: v.shape[0], : v.shape[1]]
            dense[k] = w8.astype(np.float32) * full
            quantized += 1
    names = " ".join(k for k in fp8 if k.endswith("_scale_inv"))
    for part in ("experts.3.gate_proj", "shared_experts.down_proj", "f_a_proj", "q_b_proj", "wq_b", "o_proj"):
        assert part in names, part  # the released names of every kind of projection are covered
    ids = jnp.asarray(np.load(FIXTURE / "reference.npz")["input_ids"])
    got = {}
    for name, tensors in (("fp8", fp8), ("dense", dense)):
        d = tmp_path / name
        d.mkdir()
        shutil.copy(FIXTURE / "config.json", d)
        write_safetensors(d / "model.safetensors", tensors)
        got[name] = _logits(from_pretrained(d, dtype=jnp.float32, progress=False), ids)
    assert quantized > 50 and json.loads((FIXTURE / "config.json").read_text())["model_type"] == "glm5_next"
    np.testing.assert_allclose(got["fp8"], got["dense"], rtol=1e-6, atol=1e-6)
    ref = np.load(FIXTURE / "reference.npz")["logits"]
    assert rel_err(jnp.asarray(got["fp8"]), jnp.asarray(ref)) > 1e-4


def test_glm5_config_nested_or_flat_and_refusals_name_the_field():
    import json

    from checkpoints import CheckpointError, config_from_hf

    raw = json.loads((FIXTURE / "config.json").read_text())
    nested = config_from_hf(raw)
    text = dict(raw["text_config"])
    flat = {**{k: v for k, v in raw.items() if k != "text_config"}, **text, "model_type": "glm5_next"}
    assert config_from_hf(flat) == nested
    assert nested.index_kpool == 4 and nested.hc_mult == 4 and nested.swiglu_limit == 0.5
    assert nested.indexer_types[3] == "shared" and nested.qk_rope_head_dim == 0 and nested.mla_norm_eps == 1e-5
    for change, match in (
        ({"index_topk": 10}, r"index_topk=10: must be a multiple of index_kpool=4"),
        ({"qk_rope_head_dim": 8}, r"qk_rope_head_dim=8: the DSA layers of glm5_next are NoPE"),
        ({"num_key_value_heads": 2}, r"num_key_value_heads=2 != num_attention_heads=4"),
        ({"sliding_window": 64}, r"unknown field\(s\) \['sliding_window'\]"),
    ):
        bad = {**raw, "text_config": {**text, **change}}
        with pytest.raises(CheckpointError, match=match):
            config_from_hf(bad)


def test_glm5_preset_has_the_released_parameter_count():
    """transformers 5.23's Glm5NextForConditionalGeneration text part (language_model + lm_head) built on the
    meta device from the default Glm5NextTextConfig holds 313,326,816,766 parameters; transformers keeps the
    router's score-correction bias as a buffer (288 per MoE layer), we keep it as a parameter."""
    import math

    cfg = HybridConfig.glm5_next_flash()
    model = nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0)))
    ours = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    biases = cfg.num_experts * cfg.mlp_types.count("moe")
    assert ours - biases == 313_326_816_766


@pytest.mark.slow
def test_glm5_quantized_cache_orbax_save_and_cli(tmp_path, capsys, jitted):
    """Hierarchical quantization (FP8 latent tiles of a rope-less latent, MXFP8 pooled indexer keys) decodes
    consistently and stays near float32; orbax `convert` and our `save_pretrained` reload the same weights;
    the CLI generates the fixture's greedy tokens from the folder."""
    from checkpoints import convert, from_pretrained, save_pretrained
    from hybrid_jax.cli import main
    from hybrid_jax.memory import cache_bytes

    ref = np.load(FIXTURE / "reference.npz")
    ids = jnp.asarray(ref["input_ids"])
    quant = QuantConfig.from_dict({"kv_cache": {"dtype": "fp8", "tile_size": 16}, "indexer": {"dtype": "mxfp8"}})
    model = from_pretrained(FIXTURE, dtype=jnp.float32, quant=quant, progress=False)
    cache = model.init_cache(2, 96)
    assert cache.layers[2].latent.values.dtype == jnp.float8_e4m3fn
    assert cache.layers[2].index_k.values.dtype == jnp.float8_e4m3fn
    assert cache.layers[2].index_k.values.shape[1] == cache.page_size // 4  # one pooled key per 4 tokens
    full = jitted["forward"](model, ids)
    stepped, _ = prefill_then_decode(model, ids, jitted, 70, 96)
    assert rel_err(stepped, full) < 1e-4  # the quantized cache reads back what the forward used
    assert 1e-5 < rel_err(full, ref["logits"]) < 0.05  # quantized: near the float32 reference, not equal
    per_token = cache_bytes(model.config, quant, jnp.bfloat16)["sparse MLA / token"]
    assert per_token == 32 + 32 / 16 * 4 + (32 + 1) / 4  # FP8 latent + tile scales + MXFP8 pooled key / 4

    base = from_pretrained(FIXTURE, dtype=jnp.float32, progress=False)
    convert(FIXTURE, tmp_path / "orbax", dtype=jnp.float32, progress=False)
    save_pretrained(base, tmp_path / "hybrid")
    graph, want = nnx.split(base)
    for folder in ("orbax", "hybrid"):  # the same model: structure, config, every parameter's dtype and bits
        reloaded = from_pretrained(tmp_path / folder, dtype=jnp.float32, progress=False)
        again_graph, again = nnx.split(reloaded)
        assert reloaded.config == base.config and again_graph == graph, folder
        assert jax.tree.structure(again) == jax.tree.structure(want), folder
        for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(want), strict=True):
            assert a.dtype == b.dtype, folder
            np.testing.assert_array_equal(a, b, err_msg=folder)

    gen = ",".join(str(i) for i in np.asarray(ids[0]).tolist())
    argv = ["generate", "--model", str(FIXTURE), "--prompt-ids", gen, "--max-new-tokens", "16", "--quiet"]
    assert main([*argv, "--dtype", "float32", "--compile-cache", ""]) == 0
    tokens = capsys.readouterr().out.strip().splitlines()[-1]
    assert tokens == ",".join(str(i) for i in ref["generated"][0].tolist())


def test_record_indexer_shows_pools_and_the_positions_read():
    from hybrid_jax.inspect import record_indexer

    cfg = glm5_tiny()
    model = HybridLM(cfg, rngs=nnx.Rngs(0))
    ids = random_ids(12, (1, 19), cfg.vocab_size)
    with record_indexer() as records:
        model(ids)
    assert [bool(r.get("shared")) for r in records] == [False, True, False]  # layers 2 (full), 3 (shared), 5
    full, shared = records[0], records[1]
    p = cfg.index_kpool
    assert full["pool_size"] == p and full["k"].shape == (1, 19 // p, cfg.index_head_dim)
    np.testing.assert_array_equal(full["positions"][0], (np.arange(19) + 1) // p - 1)
    np.testing.assert_array_equal(shared["indices"], full["token_indices"])
    for t in range(19):  # every token read lies in a chosen pool or in the query's own incomplete pool
        pools = set(full["indices"][0, t].tolist()) - {-1}
        read = set(full["token_indices"][0, t].tolist()) - {-1}
        assert read == {j * p + s for j in pools for s in range(p)} | set(range((t + 1) // p * p, t + 1))
        assert all(j <= (t + 1) // p - 1 for j in pools) and len(pools) == min(cfg.index_topk // p, (t + 1) // p)
        assert full["attention"].shape[-1] == 19


def test_glm5_config_fields_left_out_take_transformers_defaults():
    import json

    from checkpoints import config_from_hf

    raw = json.loads((FIXTURE / "config.json").read_text())
    left_out = ("swiglu_limit", "routed_scaling_factor", "n_shared_experts", "linear_lower_bound")
    text = {k: v for k, v in raw["text_config"].items() if k not in left_out}
    cfg = config_from_hf({**raw, "text_config": text})
    assert (cfg.swiglu_limit, cfg.routed_scaling_factor, cfg.num_shared_experts) == (10.0, 2.5, 1)
    assert cfg.kda_gate_lower_bound == -5.0
    softplus = config_from_hf({**raw, "text_config": {**text, "linear_lower_bound": None}})
    assert softplus.kda_gate_lower_bound is None
    assert config_from_hf({**raw, "text_config": {**text, "index_kpool": 128, "index_topk": 256}}).page_size == 128
