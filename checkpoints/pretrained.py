"""`from_pretrained`: one entry point for Hugging Face folders and converted orbax folders."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
from jax.sharding import Mesh

from checkpoints.hf import load_safetensors_model, load_tokenizer
from checkpoints.orbax_io import is_orbax_folder, restore_orbax
from checkpoints.safetensors_io import CheckpointError
from hybrid_jax.model import HybridLM
from hybrid_jax.quant.config import QuantConfig
from sharding.rules import LOGICAL_AXIS_RULES


def from_pretrained(
    path: str | Path,
    *,
    dtype=jnp.bfloat16,
    mesh: Mesh | None = None,
    quant: QuantConfig | str | Path | None = None,
    strict: bool = True,
    rules=LOGICAL_AXIS_RULES,
    progress: bool = True,
) -> HybridLM:
    """Load a ready HybridLM from `path`.

    `path` is a Hugging Face folder (config.json with model_type kimi_linear, deepseek_v32 or hybrid;
    model.safetensors or shards with model.safetensors.index.json) or a folder written by
    `hybrid-jax convert`. Weights are cast to `dtype` (the float32-by-design parameters stay float32, and a
    quant policy's projection dtype wins); `quant` is a QuantConfig or the path of its YAML file. With a
    `mesh`, each parameter is placed on its NamedSharding from the logical-axis `rules`. strict=False
    ignores unexpected extra tensors. The tokenizer is separate: `load_tokenizer(path)`.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a folder")
    if isinstance(quant, (str, Path)):
        quant = QuantConfig.from_yaml(quant)
    if is_orbax_folder(path):
        return restore_orbax(path, dtype=dtype, mesh=mesh, quant=quant, rules=rules)
    model = load_safetensors_model(
        path, dtype=dtype, mesh=mesh, quant=quant, strict=strict, rules=rules, progress=progress
    )
    if not (path / "tokenizer.json").is_file():
        load_tokenizer(path)  # warns that ids or a tokenizer object must be passed
    return model
