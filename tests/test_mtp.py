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

from checkpoints import from_pretrained, save_pretrained
from checkpoints.safetensors_io import CheckpointError, CheckpointFolder, write_safetensors
from hybrid_jax import HybridConfig, HybridLM, PrefixCache, generate
from hybrid_jax import speculative as spec_mod
from hybrid_jax.cli import main
from hybrid_jax.generate import prefill_with_mtp
from hybrid_jax.speculative import mtp_draft, mtp_reference_drafts
from tests.conftest import random_ids, variant_config

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


def _copying_mtp(model: HybridLM) -> HybridLM:
    """Set MTP module 0 to propose the token it is fed: eh_proj passes enorm(embed(t)) through, the mixer and FFN
    outputs are zero and the head is the module's embedding, so its draft is t itself. On a target that repeats
    its last token (the variant model), every draft is then right."""
    m = model.mtp[0]
    d = model.config.hidden_size
    m.eh_proj.kernel[...] = jnp.concatenate([jnp.eye(d), jnp.zeros((d, d))], axis=0)
    m.self_attn.o_proj.kernel[...] = jnp.zeros_like(m.self_attn.o_proj.kernel[...])
    m.mlp.down_proj.kernel[...] = jnp.zeros_like(m.mlp.down_proj.kernel[...])
    m.shared_head.head.kernel[...] = m.embed_tokens.embedding[...].T
    return model


def test_mtp_speculative_greedy_equals_plain_greedy_and_drafts_follow_the_spec(mtp_model, monkeypatch):
    """generate(draft="mtp") (prompts of mixed lengths, chunked prefill) gives plain greedy's tokens; every
    verify step's drafts inside the compiled loop equal `mtp_reference_drafts` on that row's history (recorded
    with a debug callback around `mtp_draft`); an EOS inside an accepted block; the accepted counts follow."""
    model, k, new = mtp_model, 3, 12
    lens = jnp.array([11, 6, 9])
    ids = random_ids(9, (3, 11), model.config.vocab_size)
    plain = GEN(model, ids, prompt_lengths=lens, max_new_tokens=new)
    steps = []
    original = spec_mod.mtp_draft

    def recording(model_, mcache, pend_ids, pend_hidden, n_pend, k_):
        out = original(model_, mcache, pend_ids, pend_hidden, n_pend, k_)
        jax.debug.callback(lambda *a: steps.append([np.asarray(x) for x in a]), mcache.lengths, n_pend, out[1])
        return out

    monkeypatch.setattr(spec_mod, "mtp_draft", recording)
    fresh_jit = jax.jit(generate, static_argnames=("max_new_tokens", "draft", "num_draft", "prefill_chunk"))
    spec = fresh_jit(model, ids, prompt_lengths=lens, max_new_tokens=new, draft="mtp", num_draft=k, prefill_chunk=4)
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    np.testing.assert_array_equal(spec.lengths, plain.lengths)
    assert len(steps) >= 3
    full = [np.concatenate([np.asarray(ids[r, : int(lens[r])]), np.asarray(plain.tokens[r])]) for r in range(3)]
    got, histories = [], []
    for c, n_pend, logits in steps:
        for r in np.nonzero(n_pend)[0]:
            got.append(logits[r])
            histories.append(full[r][: c[r] + n_pend[r] + 1])
    assert len(histories) >= 3 * 3
    _, want = _reference(model, histories, k)
    np.testing.assert_allclose(np.stack(got), want, rtol=1e-4, atol=1e-4)
    assert (np.asarray(spec.drafted) % k == 0).all()


def test_mtp_greedy_with_accepted_drafts_and_an_eos_inside_a_block():
    """A KDA / MLA hybrid with a dense-MLA MTP module set to copy its input token, on a target that repeats its
    last token: drafts are accepted, the output is plain greedy's, under jit, with an EOS emitted as an accepted
    draft (row 0 stops inside a block)."""
    cfg = variant_config().replace(mtp_layers=1, mtp_layer_type="full", mtp_mlp_type="dense")
    model = _copying_mtp(HybridLM(cfg, rngs=nnx.Rngs(0)))
    lens = jnp.array([13, 7, 10])
    ids = jnp.tile(random_ids(42, (3, 4), cfg.vocab_size), (1, 4))[:, :13]
    plain = GEN(model, ids, prompt_lengths=lens, max_new_tokens=14)
    spec = GEN(model, ids, prompt_lengths=lens, max_new_tokens=14, draft="mtp", num_draft=4)
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    assert (np.asarray(spec.accepted) > 0).all()
    eos = int(plain.tokens[0, 5])
    row0 = np.asarray(plain.tokens[0])
    stop = int(np.argmax(row0 == eos)) + 1
    with_eos = GEN(model, ids, prompt_lengths=lens, max_new_tokens=14, eos_id=eos, draft="mtp", num_draft=4)
    ref = GEN(model, ids, prompt_lengths=lens, max_new_tokens=14, eos_id=eos)
    np.testing.assert_array_equal(with_eos.tokens, ref.tokens)
    np.testing.assert_array_equal(with_eos.lengths, ref.lengths)
    assert int(with_eos.lengths[0]) == stop


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
    with pytest.raises(ValueError, match="init_mtp_cache.*mtp_layers=0"):
        tiny_model.init_mtp_cache(1, 8)
