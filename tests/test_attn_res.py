"""Block AttnRes bookkeeping, restated in the sub-layer form of ARCH_SPEC §5.2 and checked against the model."""

import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import random_ids, rel_err
from tests.test_model import _info


def _mix(module, sources):
    """h = Σ softmax(w · RMSNorm(v_i)) v_i, written out in numpy (float64)."""
    src = np.stack([np.asarray(s, np.float64) for s in sources], axis=-2)
    w = np.asarray(module.pseudo_queries.kernel[...], np.float64)[:, 0]
    g = np.asarray(module.attn_residual_norm.weight[...], np.float64)
    eps = module.attn_residual_norm.eps
    keys = src / np.sqrt((src**2).mean(-1, keepdims=True) + eps) * g
    logits = keys @ w
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return jnp.asarray((p[..., None] * src).sum(-2), jnp.float32)


@pytest.mark.slow
def test_block_attnres_matches_the_sub_layer_formulation(tiny_model, jitted):
    model = tiny_model
    cfg = model.config
    s = 2 * cfg.attn_res_block_size  # sub-layers per block
    ids = random_ids(3, (1, 6))
    info = _info(1, 6)
    emb = model.embed_tokens(ids)
    completed = [emb]  # b_0 = embedding, then each finished block's sum of sub-layer outputs
    partial = None  # b_n^i: sum of the outputs so far in the current block
    for l in range(2 * cfg.num_layers):
        layer = model.layers[l // 2]
        if l % s == 0 and partial is not None:
            completed.append(partial)
            partial = None
        sources = completed if partial is None else [*completed, partial]
        if l % 2 == 0:  # attention sub-layer: the pre mix (skipped when it would see the embedding only)
            h = sources[0] if len(sources) == 1 else _mix(layer.pre_attn_residual, sources)
            out = layer.self_attn(layer.input_layernorm(h), info, None)[0]
        else:
            h = _mix(layer.post_attn_residual, sources)
            out = layer.mlp(layer.post_attention_layernorm(h))
        partial = out if partial is None else partial + out
    final = _mix(model.final_attn_residual, [*completed, partial])
    expect = model.lm_head(model.norm(final))
    assert rel_err(jitted["forward"](model, ids), expect) < 1e-4
    assert len(completed) == 1 + cfg.num_layers // cfg.attn_res_block_size - 1


def test_mix_matches_float64_on_random_sources():
    """Both forms of the mix (stacked; streamed, each source read once for prefill) give the stacked float64
    formula's value, with float32 blocks and a bfloat16 partial sum of a different scale."""
    import jax
    from flax import nnx

    from hybrid_jax.layers.attn_res import AttnResMix

    d = 48
    mix = AttnResMix(d, eps=1e-5, rngs=nnx.Rngs(7))
    mix.attn_residual_norm.weight[...] = jax.random.uniform(jax.random.key(1), (d,), minval=0.5, maxval=1.5)
    ks = jax.random.split(jax.random.key(2), 4)
    blocks = [jax.random.normal(k, (2, 5, d), jnp.float32) * (i + 1) for i, k in enumerate(ks[:3])]
    partial = (jax.random.normal(ks[3], (2, 5, d), jnp.float32) * 3).astype(jnp.bfloat16)
    expect = _mix(mix, [*blocks, partial.astype(jnp.float32)])
    for form in (mix.__call__, mix._streamed):  # few rows: the stacked form; prefill-sized: the streamed one
        got = form(blocks, partial)
        assert got.dtype == jnp.bfloat16
        assert rel_err(got.astype(jnp.float32), expect) < 4e-3  # the bf16 output rounding only
        assert rel_err(form(blocks, partial.astype(jnp.float32)), expect) < 1e-6


def test_mix_streams_its_sources_from_stream_min_rows(monkeypatch):
    """Prefill-sized calls take the streamed form (no [.., n+1, D] stack in the program), decode-sized ones
    the stacked form."""
    import jax
    from flax import nnx

    from hybrid_jax.layers import attn_res

    mix = attn_res.AttnResMix(16, eps=1e-5, rngs=nnx.Rngs(0))
    monkeypatch.setattr(attn_res, "STREAM_MIN_ROWS", 8)

    def has_stack(rows):
        x = jnp.ones((1, rows, 16), jnp.float32)
        return f"f32[1,{rows},3,16]" in str(jax.make_jaxpr(lambda a: mix([a, a], a))(x))

    assert has_stack(7) and not has_stack(8)
