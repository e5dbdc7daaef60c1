"""Hierarchical quantization: MXFP8 indexer, FP8 KV cache, BF16 / FP8-resident projections."""

from hybrid_jax.quant.config import IndexerQuant, KVCacheQuant, ProjectionQuant, QuantConfig
from hybrid_jax.quant.formats import dequantize_kv_fp8, dequantize_mxfp8, quantize_kv_fp8, quantize_mxfp8

__all__ = [
    "IndexerQuant",
    "KVCacheQuant",
    "ProjectionQuant",
    "QuantConfig",
    "dequantize_kv_fp8",
    "dequantize_mxfp8",
    "quantize_kv_fp8",
    "quantize_mxfp8",
]
