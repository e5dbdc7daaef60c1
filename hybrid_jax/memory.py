"""Decode-cache memory of a configuration, from shapes only (nothing is allocated)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_jax.config import HybridConfig
from hybrid_jax.model import HybridLM
from hybrid_jax.quant.config import QuantConfig


def cache_bytes(cfg: HybridConfig, quant: QuantConfig | None = None, dtype=jnp.bfloat16) -> dict[str, float]:
    """Bytes of one layer's cache by kind: "kda state / seq" (fixed per sequence), "full MLA / token" and
    "sparse MLA / token" (per cached token, latent + rope + indexer keys with their scales); 0 for kinds
    the model lacks; "attention K/V / token" for gated GQA layers. Works for any preset size: the model and
    cache are evaluated abstractly."""
    page = cfg.page_size
    model = nnx.eval_shape(lambda: HybridLM(cfg, dtype=dtype, quant=quant, rngs=nnx.Rngs(0)))
    cache = jax.eval_shape(lambda: model.init_cache(1, page))

    def nbytes(tree) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))

    out = {"kda state / seq": 0.0, "full MLA / token": 0.0, "sparse MLA / token": 0.0}
    for kind, st in zip(cfg.layer_types, cache.layers, strict=True):
        if kind == "linear":
            out["kda state / seq"] = float(nbytes(st))
        elif kind == "attention":  # gated GQA: keys and values of every kv head (with their FP8 scales)
            out["attention K/V / token"] = nbytes(st) / page
        else:
            per_token = nbytes(st.replace(index_tail=None)) / page
            out[f"{kind} MLA / token"] = max(out[f"{kind} MLA / token"], per_token)  # a shared layer holds less
            if st.index_tail is not None:  # KPool: the incomplete pool's keys, per sequence
                out["indexer tail / seq"] = float(nbytes(st.index_tail))
    return out
