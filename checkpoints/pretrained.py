"""`from_pretrained`: one entry point for Hugging Face folders and converted orbax folders."""

from __future__ import annotations

from pathlib import Path

from jax.sharding import Mesh

from checkpoints.hf import load_safetensors_model, load_tokenizer, read_config
from checkpoints.orbax_io import is_orbax_folder, restore_orbax
from checkpoints.safetensors_io import resolve_folder
from hybrid_jax.model import HybridLM
from hybrid_jax.quant.config import QuantConfig
from sharding.rules import LOGICAL_AXIS_RULES


def from_pretrained(
    path: str | Path,
    *,
    dtype="auto",
    mesh: Mesh | None = None,
    quant: QuantConfig | str | Path | None = None,
    strict: bool = True,
    rules=LOGICAL_AXIS_RULES,
    progress: bool = True,
    mtp: bool | None = None,
) -> HybridLM:
    """Load a ready HybridLM from `path`.

    `path` is a Hugging Face folder (config.json with model_type kimi_linear, deepseek_v32 or hybrid;
    model.safetensors or shards with model.safetensors.index.json) or a folder written by
    `hybrid-jax convert`. `dtype` is the compute and weight dtype: "auto" (the default) is the checkpoint's
    own — config.json's `dtype` / `torch_dtype`, else its tensors' (an orbax folder: the dtype it was stored
    in) —, so a float32 checkpoint loads float32 and a bf16 one bf16; any other dtype casts the weights (the
    float32-by-design parameters stay float32, and a quant policy's projection dtype wins). `quant` is a
    QuantConfig or the path of its YAML file. With a `mesh`, each parameter is placed on its NamedSharding from
    the logical-axis `rules`. strict=False ignores unexpected extra tensors. The tokenizer is separate:
    `load_tokenizer(path)`; `save_pretrained` copies the tokenizer files of the folder a model came from.
    `mtp=True` also loads a checkpoint's multi-token-prediction layers (DeepSeek's `num_nextn_predict_layers`),
    the drafter of `generate(draft="mtp")`; by default a Hugging Face checkpoint's are skipped (as transformers
    skips them) and those of a folder we wrote are kept.

    The folder is not trusted: every safetensors header is validated completely before any data is read,
    every file it names must resolve inside the folder, and config.json and an orbax state must match each
    other; anything else is a one-line CheckpointError (a ValueError) naming the file and the field.
    """
    path = Path(path)
    resolve_folder(path)  # a CheckpointError unless it is a folder (or a link to one)
    if isinstance(quant, (str, Path)):
        quant = QuantConfig.from_yaml(quant)
    if is_orbax_folder(path):
        stored = read_config(path).mtp_layers  # checked before a byte of the weights is read
        if mtp is not None and bool(stored) != mtp:
            raise ValueError(
                f"mtp={mtp!r}: the orbax folder {path} stores a model with mtp_layers={stored} and restores it as "
                "stored (convert with or without --mtp)"
            )
        return restore_orbax(path, dtype=dtype, mesh=mesh, quant=quant, rules=rules)
    model = load_safetensors_model(
        path, dtype=dtype, mesh=mesh, quant=quant, strict=strict, rules=rules, progress=progress, mtp=mtp
    )
    if not (path / "tokenizer.json").exists():
        load_tokenizer(path)  # warns that ids or a tokenizer object must be passed
    return model
