"""Checkpoint I/O: Hugging Face safetensors (kimi_linear, deepseek_v32, hybrid) and orbax.

Parameter names in `hybrid_jax` follow the Hugging Face checkpoints (`self_attn.q_proj`, `kv_b_proj`,
`self_attn.indexer.wq_b`, `mlp.experts`, ...), so the mapping is one to one: a torch Linear
`weight [out, in]` is our `kernel [in, out]`, and per-expert tensors stack into `[E, ...]`.

A checkpoint folder is never trusted: headers, paths, config and orbax state are validated before loading, and
every problem is a `CheckpointError` (a ValueError) naming the file and field.
"""

from checkpoints.hf import load_tokenizer, save_pretrained
from checkpoints.hf_config import SUPPORTED_MODEL_TYPES, config_from_hf
from checkpoints.orbax_io import convert, restore_orbax, save_orbax
from checkpoints.pretrained import from_pretrained
from checkpoints.safetensors_io import CheckpointError

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "CheckpointError",
    "config_from_hf",
    "convert",
    "from_pretrained",
    "load_tokenizer",
    "restore_orbax",
    "save_orbax",
    "save_pretrained",
]
