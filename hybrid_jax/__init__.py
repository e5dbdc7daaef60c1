"""hybrid-jax: Day-0 inference for hybrid linear / sparse-attention LLMs in JAX."""

from hybrid_jax.cache import HybridCache
from hybrid_jax.config import PRESETS, HybridConfig, YarnScaling
from hybrid_jax.generate import GenerateOutput, generate, sample_logits
from hybrid_jax.model import HybridLM
from hybrid_jax.prefix_cache import PrefixCache
from hybrid_jax.tokenizer import ByteTokenizer

__all__ = [
    "ByteTokenizer",
    "GenerateOutput",
    "HybridCache",
    "HybridConfig",
    "HybridLM",
    "PRESETS",
    "PrefixCache",
    "YarnScaling",
    "generate",
    "sample_logits",
]
__version__ = "0.1.0"

_CHECKPOINT_API = ("from_pretrained", "save_pretrained", "load_tokenizer", "convert")


def __getattr__(name: str):
    # Checkpoint I/O lives in the `checkpoints` package, which imports the model; resolve it lazily so that
    # `import hybrid_jax` stays light and the dependency keeps pointing one way.
    if name in _CHECKPOINT_API:
        import checkpoints

        return getattr(checkpoints, name)
    raise AttributeError(f"module 'hybrid_jax' has no attribute {name!r}")
