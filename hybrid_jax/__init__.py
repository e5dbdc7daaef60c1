"""hybrid-jax: Day-0 inference for hybrid linear / sparse-attention LLMs in JAX."""

from hybrid_jax.cache import HybridCache
from hybrid_jax.config import PRESETS, HybridConfig, YarnScaling
from hybrid_jax.generate import GenerateOutput, generate, sample_logits
from hybrid_jax.model import HybridLM
from hybrid_jax.tokenizer import ByteTokenizer

__all__ = [
    "ByteTokenizer",
    "GenerateOutput",
    "HybridCache",
    "HybridConfig",
    "HybridLM",
    "PRESETS",
    "YarnScaling",
    "generate",
    "sample_logits",
]
__version__ = "0.1.0"
