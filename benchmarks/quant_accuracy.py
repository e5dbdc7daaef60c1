"""Accuracy and memory of the hierarchical quantization (CPU is fine). Prints four tables; their rows go
to benchmarks/results/:

1. cache bytes per token per layer type (and the fixed KDA state per sequence), BF16 vs quantized, read off
   the real cache structures of the tiny, hybrid_small, Kimi-Linear-48B and DeepSeek-V3.2 shapes;
2. indexer Top-K recall of MXFP8 q / k against BF16 scores, on random activations and with outlier channels;
3. sparse-MLA output relative error with the FP8 latent cache against BF16 latents;
4. final-logit KL(BF16 || quantized) of a random hybrid_small-shaped model over a 2K-token prompt.

    python -m benchmarks.quant_accuracy [--kl-tokens 2048] [--kl-layers 16]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.common import report
from hybrid_jax import HybridConfig, HybridLM
from hybrid_jax.cache import Pool
from hybrid_jax.memory import cache_bytes
from hybrid_jax.quant.config import QuantConfig
from pallas_kernels.indexer.reference import indexer_scores
from pallas_kernels.paged import contiguous_as_pages
from pallas_kernels.sparse_attention import sparse_mla


def bytes_table() -> list[dict]:
    rows = []
    presets = {
        "tiny": (HybridConfig.tiny(), 16),
        "hybrid_small": (HybridConfig.hybrid_small(), 128),
        "kimi_linear_48b": (HybridConfig.kimi_linear_48b(), 128),
        "deepseek_v32": (HybridConfig.deepseek_v32(), 128),
    }
    for name, (cfg, tile) in presets.items():
        q = QuantConfig.from_dict(
            {
                "indexer": {"dtype": "mxfp8"},
                "kv_cache": {"dtype": "fp8", "tile_size": tile},
                "projection": {"dtype": "bf16"},
            }
        )
        plain, quant = cache_bytes(cfg, None), cache_bytes(cfg, q)
        for key in plain:
            if plain[key]:
                rows.append(
                    {
                        "model": name,
                        "cache": key,
                        "bf16 bytes": f"{plain[key]:,.0f}",
                        "quantized bytes": f"{quant[key]:,.0f}",
                        "ratio": f"{quant[key] / plain[key]:.3f}",
                    }
                )
    return rows


def _mx(x):
    return Pool.from_rows(x, "mxfp8", 0, jnp.float32).read(jnp.float32)


def _fp8_ue8m0_128(x):
    """DeepSeek's act_quant for comparison: one power-of-two (ceil) scale per 128 elements."""
    return Pool.from_rows(x, "fp8", 128, jnp.float32).read(jnp.float32)


def _recall(ref: jax.Array, got: jax.Array, topk: int) -> np.ndarray:
    a = np.asarray(jax.lax.top_k(ref, topk)[1])[0]
    b = np.asarray(jax.lax.top_k(got, topk)[1])[0]
    return np.array([len(np.intersect1d(x, y)) / topk for x, y in zip(a, b, strict=True)])


def recall_table(topk: int = 2048, queries: int = 32, heads: int = 64, dim: int = 128):
    """Recall of the BF16 Top-K. For scale, the same table holds BF16 against float32 (the noise floor of
    the reference itself) and DeepSeek's per-128 FP8 format."""
    rows = []
    for case, keys in (("random", 8192), ("outlier channels", 8192), ("random", 32768)):
        ks = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(ks[0], (1, queries, heads, dim))
        k = jax.random.normal(ks[1], (1, keys, dim))
        w = jax.random.normal(ks[2], (1, queries, heads))
        if case == "outlier channels":  # a few channels 30-100x larger, as real activations have
            boost = jnp.ones(dim).at[jnp.array([3, 40, 77, 101])].set(jnp.array([30.0, 60.0, 100.0, 45.0]))
            q, k = q * boost, k * boost
        q16, k16 = q.astype(jnp.bfloat16), k.astype(jnp.bfloat16)
        ref = indexer_scores(q16, w, k16, scale=dim**-0.5)
        variants = {
            ("MXFP8 (OCP, 32-groups)", "bf16"): (ref, indexer_scores(_mx(q16), w, _mx(k16), scale=dim**-0.5)),
            ("FP8 ue8m0 per 128 (DeepSeek)", "bf16"): (
                ref,
                indexer_scores(_fp8_ue8m0_128(q16), w, _fp8_ue8m0_128(k16), scale=dim**-0.5),
            ),
            ("bf16", "float32"): (indexer_scores(q, w, k, scale=dim**-0.5), ref),
        }
        for (name, versus), (a, b) in variants.items():
            r = _recall(a, b, topk)
            rows.append({
                "activations": case, "keys": keys, "format": name, "vs": versus,
                "mean recall": f"{r.mean():.4f}", "min recall": f"{r.min():.4f}",
                "queries, heads x dim, top-k": f"{queries}, {heads} x {dim}, {topk}",
            })  # fmt: skip
    return rows


def attention_error_table(batch: int = 4, keys: int = 4096, topk: int = 2048, heads: int = 16):
    lat, rope = 512, 64
    ks = jax.random.split(jax.random.key(1), 4)
    c = jax.random.normal(ks[0], (batch, keys, lat))  # RMS-normalised latents have unit scale
    k_pe = jax.random.normal(ks[1], (batch, keys, rope))
    q_lat = jax.random.normal(ks[2], (batch, 1, heads, lat)) * 0.05
    q_pe = jax.random.normal(ks[3], (batch, 1, heads, rope)) * 0.05
    idx = jnp.broadcast_to(jnp.arange(0, keys, keys // topk, dtype=jnp.int32)[:topk], (batch, 1, topk))
    c16 = c.astype(jnp.bfloat16).astype(jnp.float32)
    c8 = Pool.from_rows(c, "fp8", 128, jnp.float32).read(jnp.float32)
    outs = {}
    for name, latent in (("bf16", c16), ("fp8", c8)):
        pages, table = contiguous_as_pages(jnp.concatenate([latent, k_pe.astype(jnp.bfloat16).astype(jnp.float32)], -1))
        outs[name] = sparse_mla(q_lat, q_pe, pages, table, idx, scale=(128 + 64) ** -0.5)[0]
    err = float(jnp.linalg.norm(outs["fp8"] - outs["bf16"]) / jnp.linalg.norm(outs["bf16"]))
    latent_err = float(jnp.linalg.norm(c8 - c16) / jnp.linalg.norm(c16))
    return [
        {
            "case": "sparse MLA decode",
            "batch": batch,
            "cached tokens": keys,
            "top-k": topk,
            "heads": heads,
            "latent rel err": f"{latent_err:.2e}",
            "output rel err": f"{err:.2e}",
        }
    ]


def kl_table(tokens: int, layers: int):
    n = layers
    cfg = HybridConfig.hybrid_small().replace(
        num_layers=n,
        layer_types=tuple("sparse" if i % 4 == 3 else "linear" for i in range(n)),
        mlp_types=("dense",) + ("moe",) * (n - 1),
    )
    quant = QuantConfig.hierarchical()
    plain = HybridLM(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    quantized = HybridLM(cfg, dtype=jnp.bfloat16, quant=quant, rngs=nnx.Rngs(1))
    nnx.update(quantized, nnx.state(plain, nnx.Param))  # the same weights
    ids = jax.random.randint(jax.random.key(2), (1, tokens), 0, cfg.vocab_size, jnp.int32)
    fwd = jax.jit(lambda m, i: jax.nn.log_softmax(m(i), axis=-1))
    t0 = time.perf_counter()
    lp = fwd(plain, ids)
    lq = fwd(quantized, ids)
    kl = jnp.sum(jnp.exp(lp) * (lp - lq), axis=-1)[0]
    agree = float(jnp.mean(jnp.argmax(lp, -1) == jnp.argmax(lq, -1)))
    return [
        {
            "model": f"hybrid_small widths, {n} layers ({cfg.layer_pattern}), random weights",
            "tokens": tokens,
            "mean KL (nats)": f"{float(kl.mean()):.2e}",
            "max KL": f"{float(kl.max()):.2e}",
            "argmax agreement": f"{agree:.4f}",
            "seconds": f"{time.perf_counter() - t0:.0f}",
        }
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--kl-tokens", type=int, default=2048)
    p.add_argument("--kl-layers", type=int, default=16)
    p.add_argument("--only", nargs="+", choices=["bytes", "recall", "attention", "kl"], default=None)
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args()
    jax.config.update("jax_default_matmul_precision", "highest")
    sections = {
        "bytes": ("Quantization: cache bytes, BF16 vs MXFP8 indexer keys + FP8 latent (rope part stays BF16)",
                  bytes_table),
        "recall": ("Quantization: indexer Top-K recall, MXFP8 q/k vs BF16 scores", recall_table),
        "attention": ("Quantization: attention output error with the FP8 KV cache", attention_error_table),
        "kl": ("Quantization: final-logit KL, hierarchical config vs BF16",
               lambda: kl_table(args.kl_tokens, args.kl_layers)),
    }  # fmt: skip
    for key in args.only or sections:
        title, make = sections[key]
        report("quant_accuracy.py", title, make(), record=not args.no_record)


if __name__ == "__main__":
    main()
