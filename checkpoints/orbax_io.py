"""Orbax checkpoints of a HybridLM: atomic conversion from a Hugging Face folder and sharded restore.

Layout of a converted folder:
    config.json                   our `hybrid` config (model_type hybrid)
    hybrid_jax_checkpoint.json    {"format": "orbax", "dtype": ..., "source": ...}
    state/                        orbax PyTree checkpoint of the nnx parameter state
    tokenizer files               copied from the source folder when present

A restore trusts the folder no more than a Hugging Face load does: the marker is validated, config.json and
every file under state/ must resolve inside the folder, and the state's array metadata (names, shapes, dtypes)
must match the model its config.json describes before a byte of it is read, so missing, mis-shaped or extra
arrays, or a state written for another config, are one-line CheckpointErrors naming the array.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from checkpoints.hf import LOADED_FROM, TOKENIZER_FILES, abstract_model, load_safetensors_model, read_config
from checkpoints.hf_config import config_to_hf
from checkpoints.safetensors_io import CheckpointError, read_json, regular_file, resolve_folder, resolve_inside
from hybrid_jax.model import HybridLM
from hybrid_jax.quant.config import ProjectionQuant, QuantConfig
from sharding.rules import LOGICAL_AXIS_RULES, param_sharding

MARKER = "hybrid_jax_checkpoint.json"


def is_orbax_folder(path: str | Path) -> bool:
    marker = Path(path) / MARKER
    return marker.exists() or marker.is_symlink()


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
    dtype="auto",
    quant: QuantConfig | None = None,
    force: bool = False,
    progress: bool = True,
    mtp: bool | None = None,
) -> Path:
    """Hugging Face folder -> orbax folder (see `save_orbax`), in `dtype` ("auto": the checkpoint's own, so a
    float32 checkpoint stays float32). With `quant.projection.dtype == "fp8"` the projections are stored
    FP8-resident. mtp: keep the checkpoint's multi-token-prediction layers (as `from_pretrained(mtp=)`)."""
    hf_dir = Path(hf_dir)
    out = Path(out_dir)
    if out.exists() and not force:  # fail before the (long) load
        raise FileExistsError(f"{out} exists; pass force=True (--force) to overwrite it")
    model = load_safetensors_model(hf_dir, dtype=dtype, quant=quant, progress=progress, mtp=mtp)
    root = resolve_folder(hf_dir)
    extra = tuple(
        regular_file(resolve_inside(root, f), str(hf_dir / f))
        for f in TOKENIZER_FILES
        if (hf_dir / f).exists() or (hf_dir / f).is_symlink()
    )
    return save_orbax(model, out, force=force, source=str(hf_dir.absolute()), extra_files=extra)


def restore_orbax(
    path: str | Path, *, dtype="auto", mesh: Mesh | None = None, quant=None, rules=LOGICAL_AXIS_RULES
) -> HybridLM:
    """Restore a converted folder in `dtype` ("auto" or None: the dtype it was stored in; a wider one than that
    warns: the extra precision is not in the weights); with a mesh, every parameter lands on its NamedSharding
    from the rules."""
    root = resolve_folder(path)
    meta = _read_marker(root)
    config = read_config(root)
    state_dir = _state_dir(root)
    stored = jnp.dtype(meta["dtype"])
    dtype = stored if dtype is None or (isinstance(dtype, str) and dtype == "auto") else jnp.dtype(dtype)
    if jnp.finfo(dtype).bits > jnp.finfo(stored).bits or jnp.finfo(dtype).nmant > jnp.finfo(stored).nmant:
        warnings.warn(
            f"{root} holds {stored.name} weights; loading them as {dtype.name} adds no precision "
            f"(convert with --dtype {dtype.name} from the original checkpoint for that)",
            stacklevel=3,
        )
    quant = quant or QuantConfig()
    saved = meta.get("projection", "none")
    if quant.projection.dtype == "none":
        quant = dataclasses.replace(quant, projection=ProjectionQuant(saved))
    elif quant.projection.dtype != saved:
        raise CheckpointError(
            f"{root} was converted with projection dtype {saved!r}; it cannot be restored as "
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
            _check_state(state_dir, ckpt.metadata(state_dir), abstract)
            restored = ckpt.restore(state_dir, abstract)
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{state_dir}: cannot restore the orbax state ({' '.join(str(e).split())})") from None
    nnx.replace_by_pure_dict(params, restored)
    model = nnx.merge(graphdef, params)
    LOADED_FROM[model] = root
    return model


def _read_marker(root: Path) -> dict:
    what = str(root / MARKER)
    meta = read_json(regular_file(resolve_inside(root, MARKER), what), what)
    if not isinstance(meta, dict):
        raise CheckpointError(f"{what}: not a JSON object")
    if meta.get("format") != "orbax":
        raise CheckpointError(f"{what}: format {meta.get('format')!r} is not 'orbax'")
    if "dtype" not in meta:
        raise CheckpointError(f"{what}: no dtype")
    try:
        floating = isinstance(meta["dtype"], str) and jnp.issubdtype(jnp.dtype(meta["dtype"]), jnp.floating)
    except TypeError:
        floating = False
    if not floating:
        raise CheckpointError(f"{what}: dtype {meta['dtype']!r} is not a floating-point dtype name")
    if meta.get("projection", "none") not in ("bf16", "fp32", "fp8", "none"):
        raise CheckpointError(f"{what}: projection {meta['projection']!r} is not one of bf16, fp32, fp8, none")
    return meta


def _state_dir(root: Path) -> Path:
    """state/, and everything under it, inside the folder: tensorstore would follow any link out of it."""
    state = resolve_inside(root, "state")
    if not state.is_dir():
        raise CheckpointError(f"{root / 'state'}: missing or not a folder")
    for here, dirs, files in os.walk(state):
        for name in dirs + files:
            p = Path(here) / name
            if p.is_symlink():
                resolve_inside(root, str(p.relative_to(root)), str(p))
    return state


def _flat(tree, prefix: str = "") -> dict:
    """{dotted path: leaf} of a nested dict."""
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        out.update(_flat(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


def _check_state(state_dir: Path, metadata, abstract: dict) -> None:
    """The saved arrays (from orbax's metadata, no data read) against the model the config describes."""
    tree = getattr(metadata, "item_metadata", metadata)
    tree = getattr(tree, "tree", tree)
    stored = {
        ".".join(str(getattr(k, "key", k)) for k in path): leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }
    want = _flat(abstract)
    hint = "; was the state written for another config (config.json)?"
    missing = sorted(set(want) - set(stored))
    if missing:
        k = missing[0]
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(
            f"{state_dir}: parameter {k} {tuple(want[k].shape)} {want[k].dtype} is missing{more}{hint}"
        )
    extra = sorted(set(stored) - set(want))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointError(f"{state_dir}: unexpected array {extra[0]}{more}{hint}")
    for k in sorted(want):
        shape, dtype = getattr(stored[k], "shape", None), getattr(stored[k], "dtype", None)
        if shape is None or tuple(shape) != tuple(want[k].shape):
            raise CheckpointError(
                f"{state_dir}: array {k} has shape {shape}, the model's is {tuple(want[k].shape)}{hint}"
            )
        if dtype is None or jnp.issubdtype(jnp.dtype(dtype), jnp.floating) != jnp.issubdtype(
            want[k].dtype, jnp.floating
        ):
            raise CheckpointError(f"{state_dir}: array {k} is {dtype}; the parameter is {want[k].dtype} (floating)")
