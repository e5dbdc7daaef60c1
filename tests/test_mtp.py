"""Multi-token prediction: the MTP module's cached drafting against its uncached specification
(`mtp_reference_drafts`), inside the jitted speculative loop and step by step through prefill, verify and commit;
greedy output of `generate(draft="mtp")` equals plain greedy; DeepSeek-V3.2's MTP layer loads (mtp=True), is skipped
by default and round-trips through our format; bad arguments."""

import json
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from checkpoints import convert, from_pretrained, save_pretrained
from checkpoints.safetensors_io import CheckpointError, CheckpointFolder, write_safetensors
from hybrid_jax import HybridConfig, HybridLM, PrefixCache, generate
from hybrid_jax import speculative as spec_mod
from hybrid_jax.cache import StepInfo
from hybrid_jax.cli import main
from hybrid_jax.generate import prefill_with_mtp
from hybrid_jax.speculative import mtp_draft, mtp_reference_drafts
from tests.conftest import random_ids

FIXTURES = Path(__file__).parent / "fixtures"
GEN = jax.jit(generate, static_argnames=("max_new_tokens", "top_k", "eos_id", "draft", "num_draft", "on_token"))


def mtp_tiny() -> HybridConfig:
    """The tiny hybrid (KDA, sparse and dense MLA, MoE) with plain residuals and one sparse-MLA + MoE MTP module."""
    return HybridConfig.tiny().replace(attn_res_block_size=None, mtp_layers=1)


@pytest.fixture(scope="module")
def mtp_model():
    return HybridLM(mtp_tiny(), rngs=nnx.Rngs(3))


REFERENCE = jax.jit(mtp_reference_drafts, static_argnums=3)
DRAFT = jax.jit(mtp_draft, static_argnums=5)
PAD = 32  # histories are padded to one length: one compile of the reference


def _reference(model, histories: list[np.ndarray], k: int):
    """`mtp_reference_drafts` of each history (t_0 .. t_L) -> (drafts [n, k], logits [n, k, V]) as numpy."""
    tokens = np.zeros((len(histories), PAD), np.int32)
    for i, h in enumerate(histories):
        tokens[i, : len(h)] = h
    drafts, logits = REFERENCE(model, jnp.asarray(tokens), jnp.asarray([len(h) for h in histories]), k)
    return np.asarray(drafts), np.asarray(logits)


def test_mtp_drafting_steps_match_the_uncached_reference(mtp_model):
    """Prompts of mixed lengths through `prefill_with_mtp` in 5-token calls; draft; verify a block and commit a
    different prefix per row (4, 1, 2 tokens); draft again. Each time the k drafts' logits equal the
    specification's on the row's history, and after drafting the MTP cache holds exactly the rows a one-shot
    `prefill_with_mtp` of that history holds (draft rows rolled back, pool rows past the length cleared)."""
    model, k, b = mtp_model, 3, 3
    cfg = model.config
    lens = np.array([12, 5, 9])
    ids = random_ids(5, (b, 12), cfg.vocab_size)
    cache, mcache = model.init_cache(b, 40), model.init_mtp_cache(b, 40)
    _, cache, mcache, h_last = prefill_with_mtp(model, ids, jnp.asarray(lens), cache, mcache, chunk=5)
    np.testing.assert_array_equal(mcache.lengths, lens - 1)
    first = np.asarray(random_ids(6, (b,), cfg.vocab_size))
    pend_ids = jnp.zeros((b, k + 1), jnp.int32).at[:, 0].set(first)
    pend_h = jnp.zeros((b, k + 1, cfg.hidden_size)).at[:, 0].set(h_last)
    drafts, logits, mcache = DRAFT(model, mcache, pend_ids, pend_h, jnp.ones((b,), jnp.int32), k)
    np.testing.assert_array_equal(mcache.lengths, lens)
    histories = [np.concatenate([np.asarray(ids[r, : lens[r]]), first[r : r + 1]]) for r in range(b)]
    want_d, want_l = _reference(model, histories, k)
    np.testing.assert_allclose(logits, want_l, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(drafts, want_d)

    block = jnp.concatenate([jnp.asarray(first)[:, None], random_ids(7, (b, k), cfg.vocab_size)], axis=1)
    _, pending, hidden = jax.jit(lambda m, x, c: m.verify(x, c, return_hidden=True))(model, block, cache)
    keep = np.array([4, 1, 2])
    y = np.asarray(random_ids(8, (b,), cfg.vocab_size))  # the token after the kept ones
    rows = [np.concatenate([np.asarray(block[r, 1 : keep[r]]), y[r : r + 1]]) for r in range(b)]
    pend_ids = jnp.asarray(np.stack([np.pad(x, (0, k + 1 - len(x))) for x in rows]))
    drafts, logits, mcache = DRAFT(model, mcache, pend_ids, hidden, jnp.asarray(keep), k)
    np.testing.assert_array_equal(mcache.lengths, lens + keep)
    histories = [np.concatenate([histories[r], rows[r]]) for r in range(b)]
    want_d, want_l = _reference(model, histories, k)
    np.testing.assert_allclose(logits, want_l, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(drafts, want_d)
    # the MTP cache == one built in one shot from these histories (rows 0 .. len + keep - 1, the rest cleared)
    fresh = np.zeros((b, PAD), np.int32)
    for r, h in enumerate(histories):
        fresh[r, : len(h)] = h
    n = jnp.asarray([len(h) for h in histories])
    fresh_c, fresh_m = model.init_cache(b, 40), model.init_mtp_cache(b, 40)
    _, _, fresh_m, _ = prefill_with_mtp(model, jnp.asarray(fresh), n, fresh_c, fresh_m, chunk=64)
    np.testing.assert_array_equal(fresh_m.lengths, mcache.lengths)
    for got, want in zip(jax.tree.leaves(mcache.layers), jax.tree.leaves(fresh_m.layers), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


def _scaled_mtp(model: HybridLM, eps: float) -> HybridLM:
    """Set MTP module 0 to (nearly) propose the token it is fed: eh_proj passes enorm(embed(t)) through, the
    mixer's and FFN's output projections are scaled by `eps` and the head is the module's embedding. eps = 0:
    the decoder layer is the identity and the draft is t itself; a small eps keeps that draft while every row
    the module attends to moves its logits (so a wrong pending row shows)."""
    m = model.mtp[0]
    d = model.config.hidden_size
    m.eh_proj.kernel[...] = jnp.concatenate([jnp.eye(d), jnp.zeros((d, d))], axis=0)
    m.self_attn.o_proj.kernel[...] = eps * m.self_attn.o_proj.kernel[...]
    mlp = m.mlp
    down = mlp.down_proj.kernel if hasattr(mlp, "down_proj") else mlp.experts.down_proj
    down[...] = eps * down[...]
    if hasattr(mlp, "shared_experts"):
        mlp.shared_experts.down_proj.kernel[...] = eps * mlp.shared_experts.down_proj.kernel[...]
    m.shared_head.head.kernel[...] = m.embed_tokens.embedding[...].T
    return model


def test_mtp_equations_against_a_numpy_transcription():
    """The module's rows, written out in numpy from its weights (the vLLM form): x = eh_proj([enorm(E[t]);
    hnorm(h)]) with E[t] zeroed at position 0, and, with the decoder layer made the identity (eps = 0), logits =
    head(norm(x)). Distinct random norm weights, so swapped norms or halves show."""
    cfg = mtp_tiny()
    model = _scaled_mtp(HybridLM(cfg, rngs=nnx.Rngs(4)), 0.0)
    m = model.mtp[0]
    rng = np.random.default_rng(1)
    d = cfg.hidden_size
    m.enorm.weight[...] = jnp.asarray(1 + 0.5 * rng.standard_normal(d), jnp.float32)
    m.hnorm.weight[...] = jnp.asarray(1 + 0.5 * rng.standard_normal(d), jnp.float32)
    m.shared_head.norm.weight[...] = jnp.asarray(1 + 0.5 * rng.standard_normal(d), jnp.float32)
    m.eh_proj.kernel[...] = jnp.asarray(rng.standard_normal((2 * d, d)) / np.sqrt(2 * d), jnp.float32)
    b, t = 2, 7
    ids = np.asarray(random_ids(3, (b, t), cfg.vocab_size))
    hidden = rng.standard_normal((b, t, d)).astype(np.float32)
    logits, g, _ = m.step(jnp.asarray(ids), jnp.asarray(hidden), StepInfo.uncached(b, t), None)

    def rms(x, w):
        return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + cfg.rms_norm_eps)

    e = np.asarray(m.embed_tokens.embedding[...])[ids]
    e[:, 0] = 0.0  # position 0
    x = np.concatenate([rms(e, np.asarray(m.enorm.weight[...])), rms(hidden, np.asarray(m.hnorm.weight[...]))], -1)
    x = x @ np.asarray(m.eh_proj.kernel[...])
    want = rms(x, np.asarray(m.shared_head.norm.weight[...])) @ np.asarray(m.shared_head.head.kernel[...])
    np.testing.assert_allclose(np.asarray(g), x, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-4, atol=1e-4)


def test_mtp_in_the_compiled_loop_follows_the_spec_with_accepted_drafts_and_an_eos(monkeypatch):
    """generate(draft="mtp") on a KDA / sparse-MLA / MoE hybrid whose MTP module (sparse MLA + MoE) nearly copies
    its input token, on a target that mostly repeats its last token (tied embeddings): drafts are accepted, so
    verify steps leave several pending rows. Every drafting call inside the compiled loop (recorded around
    `mtp_draft`; prompts of mixed lengths, chunked prefill) gives the drafts' logits of `mtp_reference_drafts` on
    that row's history; the output is plain greedy's. Row 1 is ended by an EOS at its first token: a row done from
    the start drafts nothing beside rows that keep drafting (one compiled run covers both: CI time). An EOS
    emitted as an accepted draft inside a block is the loop's, whatever the drafter: tests/test_speculative.py."""
    cfg = mtp_tiny().replace(tie_word_embeddings=True)
    model = _scaled_mtp(HybridLM(cfg, rngs=nnx.Rngs(0)), 0.05)
    k, new = 3, 12
    lens = jnp.array([11, 6, 9])
    ids = random_ids(9, (3, 11), cfg.vocab_size)
    tokens = np.asarray(GEN(model, ids, prompt_lengths=lens, max_new_tokens=new).tokens)
    eos = int(tokens[1, 0])
    assert eos not in tokens[[0, 2]]
    plain = GEN(model, ids, prompt_lengths=lens, max_new_tokens=new, eos_id=eos)
    np.testing.assert_array_equal(plain.lengths, [new, 1, new])
    steps = []
    original = spec_mod.mtp_draft

    def recording(model_, mcache, pend_ids, pend_hidden, n_pend, k_):
        out = original(model_, mcache, pend_ids, pend_hidden, n_pend, k_)
        jax.debug.callback(lambda *a: steps.append([np.asarray(x) for x in a]), mcache.lengths, n_pend, out[1])
        return out

    monkeypatch.setattr(spec_mod, "mtp_draft", recording)
    static = ("max_new_tokens", "draft", "num_draft", "prefill_chunk", "eos_id")
    fresh_jit = jax.jit(generate, static_argnames=static)
    spec = fresh_jit(
        model, ids, prompt_lengths=lens, max_new_tokens=new, eos_id=eos, draft="mtp", num_draft=k, prefill_chunk=4
    )
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    np.testing.assert_array_equal(spec.lengths, plain.lengths)
    assert (np.asarray(spec.accepted)[[0, 2]] > 0).all() and int(spec.drafted[1]) == 0
    full = [np.concatenate([np.asarray(ids[r, : int(lens[r])]), tokens[r]]) for r in range(3)]
    got, histories = [], []
    for c, n_pend, logits in steps:
        assert n_pend[1] == 0  # the ended row never drafts
        for r in np.nonzero(n_pend)[0]:
            got.append(logits[r])
            histories.append(full[r][: c[r] + n_pend[r] + 1])
    assert max(int(n.max()) for _, n, _ in steps) > 1  # steps after accepted drafts: several pending rows
    _, want = _reference(model, histories, k)
    np.testing.assert_allclose(np.stack(got), want, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------- checkpoints
def _with_mtp_layer(tmp_path: Path) -> tuple[Path, dict]:
    """The deepseek_v32 fixture plus a DeepSeek-V3.2-style MTP layer (`model.layers.3.*`: enorm, hnorm, eh_proj,
    its own embed_tokens and shared_head, and a decoder layer built from layer 2's tensors, perturbed)."""
    src = FIXTURES / "deepseek_v32"
    dst = tmp_path / "dsv32_mtp"
    shutil.copytree(src, dst)
    reader = CheckpointFolder(dst)
    tensors = {n: np.asarray(reader[n]) for n in reader}
    rng = np.random.default_rng(0)
    extra = {}
    for n, v in tensors.items():
        if n.startswith("model.layers.2."):
            extra[n.replace("model.layers.2.", "model.layers.3.")] = (v + 0.01 * rng.standard_normal(v.shape)).astype(
                v.dtype
            )
    d = tensors["model.embed_tokens.weight"].shape[1]
    vocab = tensors["model.embed_tokens.weight"].shape[0]
    extra["model.layers.3.enorm.weight"] = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    extra["model.layers.3.hnorm.weight"] = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    extra["model.layers.3.eh_proj.weight"] = (0.1 * rng.standard_normal((d, 2 * d))).astype(np.float32)
    extra["model.layers.3.embed_tokens.weight"] = rng.standard_normal((vocab, d)).astype(np.float32)
    extra["model.layers.3.shared_head.norm.weight"] = np.ones(d, np.float32)
    extra["model.layers.3.shared_head.head.weight"] = (0.1 * rng.standard_normal((vocab, d))).astype(np.float32)
    del reader
    write_safetensors(dst / "model.safetensors", {**tensors, **extra})
    raw = json.loads((dst / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 1
    (dst / "config.json").write_text(json.dumps(raw))
    return dst, extra


def test_deepseek_mtp_layer_loads_skips_by_default_and_round_trips(tmp_path, capsys):
    path, extra = _with_mtp_layer(tmp_path)
    plain = from_pretrained(path, dtype=jnp.float32, progress=False)
    assert plain.config.mtp_layers == 0 and not hasattr(plain, "mtp")
    model = from_pretrained(path, dtype=jnp.float32, progress=False, mtp=True)
    assert model.config.mtp_layers == 1
    m = model.mtp[0]
    np.testing.assert_array_equal(m.eh_proj.kernel[...], extra["model.layers.3.eh_proj.weight"].T)
    np.testing.assert_array_equal(m.enorm.weight[...], extra["model.layers.3.enorm.weight"])
    np.testing.assert_array_equal(m.embed_tokens.embedding[...], extra["model.layers.3.embed_tokens.weight"])
    np.testing.assert_array_equal(m.shared_head.head.kernel[...], extra["model.layers.3.shared_head.head.weight"].T)
    np.testing.assert_array_equal(m.self_attn.q_a_proj.kernel[...], extra["model.layers.3.self_attn.q_a_proj.weight"].T)
    np.testing.assert_array_equal(
        m.mlp.experts.down_proj[...][5], extra["model.layers.3.mlp.experts.5.down_proj.weight"].T
    )
    ids = random_ids(11, (2, 9), model.config.vocab_size)
    np.testing.assert_array_equal(model(ids), plain(ids))  # the MTP layer changes nothing of the target
    out = GEN(model, ids, max_new_tokens=8, draft="mtp", num_draft=2)
    np.testing.assert_array_equal(out.tokens, GEN(plain, ids, max_new_tokens=8).tokens)
    # our format keeps it; from_pretrained of that folder gets it back by default, mtp=False drops it
    save_pretrained(model, tmp_path / "saved")
    again = from_pretrained(tmp_path / "saved", progress=False)
    assert again.config.mtp_layers == 1
    pairs = zip(nnx.to_flat_state(nnx.state(again.mtp)), nnx.to_flat_state(nnx.state(model.mtp)), strict=True)
    for (p, a), (_, w) in pairs:
        np.testing.assert_array_equal(a.get_value(), w.get_value(), err_msg=str(p))
    assert from_pretrained(tmp_path / "saved", progress=False, mtp=False).config.mtp_layers == 0
    # the CLI: --draft mtp loads the layer and prints plain greedy's tokens
    run = ["generate", "--model", str(tmp_path / "saved"), "--prompt-ids", "5,6,7,8,9", "--max-new-tokens", "6"]
    lines = []
    for extra in ([], ["--draft", "mtp", "--num-draft", "2"]):
        assert main([*run, "--compile-cache", "", *extra]) == 0
        out = capsys.readouterr().out
        lines.append(re.search(r"^tokens: \[.*\]$", out, re.M).group(0))
    assert lines[0] == lines[1] and re.search(r"speculative \(mtp\): \d+ of \d+ drafted tokens accepted", out), out
    with pytest.raises(CheckpointError, match="mtp=True, but .* declares no multi-token-prediction layer"):
        from_pretrained(FIXTURES / "deepseek_v32", progress=False, mtp=True)
    # orbax: convert keeps the layer with mtp=True; a restore that asks otherwise fails before reading weights
    convert(path, tmp_path / "orbax", mtp=True, progress=False)
    assert from_pretrained(tmp_path / "orbax").config.mtp_layers == 1
    with pytest.raises(ValueError, match="mtp=False: the orbax folder .* stores a model with mtp_layers=1"):
        from_pretrained(tmp_path / "orbax", mtp=False)


def test_mtp_layer_without_its_own_embedding_and_head_reads_the_models(tmp_path):
    """A checkpoint whose MTP layer leaves out `embed_tokens` and `shared_head.head` (shared by design) loads them
    from the model's embedding and LM head."""
    path, _ = _with_mtp_layer(tmp_path)
    reader = CheckpointFolder(path)
    own = ("model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight")
    tensors = {n: np.asarray(reader[n]) for n in reader if n not in own}
    del reader
    write_safetensors(path / "model.safetensors", tensors)
    model = from_pretrained(path, dtype=jnp.float32, progress=False, mtp=True)
    np.testing.assert_array_equal(model.mtp[0].embed_tokens.embedding[...], tensors["model.embed_tokens.weight"])
    np.testing.assert_array_equal(model.mtp[0].shared_head.head.kernel[...], tensors["lm_head.weight"].T)


def test_bad_mtp_arguments_raise_naming_the_value(mtp_model, tiny_model):
    ids = random_ids(1, (1, 6), 288)
    with pytest.raises(ValueError, match="draft='mtp'.*mtp_layers=0"):
        generate(tiny_model, ids, max_new_tokens=2, draft="mtp")
    with pytest.raises(ValueError, match="draft='mtp' with prefix_cache"):
        pc = PrefixCache(mtp_model, max_tokens=64, block_size=16)
        generate(mtp_model, ids, max_new_tokens=2, draft="mtp", prefix_cache=pc)
    with pytest.raises(ValueError, match="mtp_layer_type='linear'"):
        mtp_tiny().replace(mtp_layer_type="linear")
    with pytest.raises(ValueError, match="mtp_layers=1.*plain residuals"):
        HybridConfig.tiny().replace(mtp_layers=1)
    with pytest.raises(ValueError, match="mtp_layers=-1"):
        mtp_tiny().replace(mtp_layers=-1)
    with pytest.raises(ValueError, match="prefill_chunk=0 must be a positive int"):
        generate(mtp_model, ids, max_new_tokens=2, draft="mtp", prefill_chunk=0)
    with pytest.raises(ValueError, match="init_mtp_cache.*mtp_layers=0"):
        tiny_model.init_mtp_cache(1, 8)
