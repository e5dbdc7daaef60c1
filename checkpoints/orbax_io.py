"""Orbax checkpoints of a HybridLM: atomic conversion from a Hugging Face folder and sharded restore.

Layout of a converted folder:
    config.json                   our `hybrid` config (model_type hybrid)
    hybrid_jax_checkpoint.json    {"format": "orbax", "dtype": ..., "source": ...}
    state/                        orbax PyTree checkpoint of the nnx parameter state
    tokenizer files               copied from the source folder when present
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from checkpoints.hf import abstract_model, load_safetensors_model, read_config
from checkpoints.hf_config import config_to_hf
from checkpoints.safetensors_io import CheckpointError
from hybrid_jax.model import HybridLM
from hybrid_jax.quant.config import ProjectionQuant, QuantConfig
from sharding.rules import LOGICAL_AXIS_RULES, param_sharding

MARKER = "hybrid_jax_checkpoint.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def is_orbax_folder(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


def save_orbax(
    model: HybridLM, out_dir: str | Path, *, force: bool = False, source: str = "", extra_files: tuple[Path, ...] = ()
) -> Path:
    """Write `model` to `out_dir` atomically: everything goes to a temporary sibling folder that is renamed
    into place only when complete. An existing `out_dir` is replaced only with force=True."""
    out = Path(out_dir).absolute()
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists; pass force=True (--force) to overwrite it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        state = nnx.state(model, nnx.Param)
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(tmp / "state", nnx.to_pure_dict(state))  # plain nested dict of arrays
            ckpt.wait_until_finished()
        (tmp / "config.json").write_text(json.dumps(config_to_hf(model.config), indent=2) + "\n")
        meta = {
            "format": "orbax",
            "dtype": model.dtypes.compute.name,
            "source": source,
            "projection": model.quant.projection.dtype,
        }  # the parameter structure depends on it
        (tmp / MARKER).write_text(json.dumps(meta) + "\n")
        for f in extra_files:
            shutil.copy2(f, tmp / f.name)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def convert(
    hf_dir: str | Path,
    out_dir: str | Path,
    *,
    dtype=jnp.bfloat16,
    quant: QuantConfig | None = None,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Hugging Face folder -> orbax folder (see `save_orbax`). With `quant.projection.dtype == "fp8"` the
    projections are stored FP8-resident."""
    hf_dir = Path(hf_dir)
    out = Path(out_dir)
    if out.exists() and not force:  # fail before the (long) load
        raise FileExistsError(f"{out} exists; pass force=True (--force) to overwrite it")
    model = load_safetensors_model(hf_dir, dtype=dtype, quant=quant, progress=progress)
    extra = tuple(hf_dir / f for f in TOKENIZER_FILES if (hf_dir / f).is_file())
    return save_orbax(model, out, force=force, source=str(hf_dir.absolute()), extra_files=extra)


def restore_orbax(
    path: str | Path, *, dtype=None, mesh: Mesh | None = None, quant=None, rules=LOGICAL_AXIS_RULES
) -> HybridLM:
    """Restore a converted folder; with a mesh, every parameter lands on its NamedSharding from the rules."""
    path = Path(path)
    meta = json.loads((path / MARKER).read_text())
    config = read_config(path)
    dtype = jnp.dtype(dtype or meta["dtype"])
    quant = quant or QuantConfig()
    saved = meta.get("projection", "none")
    if quant.projection.dtype == "none":
        quant = dataclasses.replace(quant, projection=ProjectionQuant(saved))
    elif quant.projection.dtype != saved:
        raise CheckpointError(
            f"{path} was converted with projection dtype {saved!r}; it cannot be restored as "
            f"{quant.projection.dtype!r} (convert again with that policy)"
        )
    graphdef, params = nnx.split(abstract_model(config, dtype, quant))  # HybridLM holds only Params

    def target(_, var):
        value = var.get_value()
        if mesh is not None:
            sharding = param_sharding(var, mesh, rules)
        else:
            sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)

    abstract = nnx.to_pure_dict(nnx.map_state(target, params))
    try:
        with ocp.StandardCheckpointer() as ckpt:
            restored = ckpt.restore(path / "state", abstract)
    except (FileNotFoundError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot restore the orbax state ({e})") from e
    nnx.replace_by_pure_dict(params, restored)
    return nnx.merge(graphdef, params)
