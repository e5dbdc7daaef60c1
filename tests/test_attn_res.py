"""Block AttnRes bookkeeping, restated in the sub-layer form of ARCH_SPEC §5.2 and checked against the model."""

import jax.numpy as jnp
import numpy as np

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
            out, _ = layer.self_attn(layer.input_layernorm(h), info, None)
        else:
            h = _mix(layer.post_attn_residual, sources)
            out = layer.mlp(layer.post_attention_layernorm(h))
        partial = out if partial is None else partial + out
    final = _mix(model.final_attn_residual, [*completed, partial])
    expect = model.lm_head(model.norm(final))
    assert rel_err(jitted["forward"](model, ids), expect) < 1e-4
    assert len(completed) == 1 + cfg.num_layers // cfg.attn_res_block_size - 1
