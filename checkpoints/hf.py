"""`from_pretrained` / `save_pretrained`: Hugging Face folders <-> HybridLM.

Our parameter paths follow the Hugging Face names, so each parameter is found by a rule:
`layers.3.self_attn.q_proj.kernel [in, out]` <- `model.layers.3.self_attn.q_proj.weight [out, in]`, with
a few reshapes (conv kernels, A_log), per-expert tensors stacked into `[E, ...]` (or HF's fused
`gate_up_proj`), `block_sparse_moe` accepted for `mlp`, and FP8 weights with `weight_scale_inv` 128x128
block scales dequantised. Tensors are read one at a time from memory-mapped files and placed directly on
their target sharding, so host memory stays near the size of the largest (stacked) tensor.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from tqdm.auto import tqdm

from checkpoints.hf_config import config_from_hf, config_to_hf
from checkpoints.safetensors_io import CheckpointError, CheckpointFolder, write_safetensors
from hybrid_jax.config import HybridConfig
from hybrid_jax.layers.common import quantize_fp8_blocks
from hybrid_jax.model import HybridLM
from hybrid_jax.quant.config import QuantConfig
from sharding.rules import LOGICAL_AXIS_RULES, param_sharding

FP8_BLOCK = 128
# Tensors a checkpoint may carry that inference does not use.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


@dataclass
class Source:
    """How one parameter is built: the checkpoint tensors it reads and the function combining them."""

    names: list[str]
    build: Callable[[list[np.ndarray]], np.ndarray]


def _t(x: np.ndarray) -> np.ndarray:
    return x.T


def _weight(reader: CheckpointFolder, name: str) -> np.ndarray:
    """A tensor as float32-or-native numpy, FP8 block-scaled weights dequantised (ARCH_SPEC §4.3)."""
    w = reader[name]
    scale_name = name + "_scale_inv" if name.endswith(".weight") else None
    if scale_name and scale_name in reader:
        s = np.asarray(reader[scale_name], np.float32)
        rows, cols = w.shape
        s_full = np.repeat(np.repeat(s, FP8_BLOCK, axis=0)[:rows], FP8_BLOCK, axis=1)[:, :cols]
        return w.astype(np.float32) * s_full
    return w


def _first_present(reader, candidates: list[str]) -> str | None:
    return next((c for c in candidates if c in reader), None)


def _source(path: tuple, cfg: HybridConfig, reader: CheckpointFolder) -> Source:
    """The checkpoint recipe of one parameter path of HybridLM."""
    key = ".".join(map(str, path))
    if key == "embed_tokens.embedding":
        return Source(["model.embed_tokens.weight"], lambda t: t[0])
    hf = key if key.startswith("lm_head.") else "model." + key
    if hf.endswith(".kernel_scale_inv"):  # FP8-resident projection: torch [out/128, in/128] -> ours [in/128, out/128]
        return Source([hf[: -len(".kernel_scale_inv")] + ".weight_scale_inv"], lambda t: t[0].T)
    if hf.endswith(".kernel"):
        hf = hf[: -len(".kernel")] + ".weight"
    alternatives = [hf]
    if ".mlp." in hf:  # Kimi's released and HF-saved checkpoints call the FFN block_sparse_moe
        alternatives.append(hf.replace(".mlp.", ".block_sparse_moe."))

    m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)", hf)
    if m:
        return _expert_source(int(m.group(1)), m.group(2), cfg, reader)
    name = _first_present(reader, alternatives) or alternatives[0]
    if re.search(r"_conv1d\.weight$", name):  # torch [C, 1, W] -> ours [W, C]
        return Source([name], lambda t: t[0].reshape(t[0].shape[0], -1).T)
    if name.endswith(".A_log"):  # stored [1, 1, H, 1] (released) or [H]
        return Source([name], lambda t: t[0].reshape(-1))
    if key.endswith(".kernel"):
        return Source([name], lambda t: _t(t[0]))
    return Source([name], lambda t: t[0])


def _expert_source(layer: int, which: str, cfg: HybridConfig, reader: CheckpointFolder) -> Source:
    e, f = cfg.num_experts, cfg.moe_intermediate_size
    kimi_names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    for block in ("mlp", "block_sparse_moe"):
        prefix = f"model.layers.{layer}.{block}.experts"
        for per_expert in (which, kimi_names[which]):
            names = [f"{prefix}.{i}.{per_expert}.weight" for i in range(e)]
            if names[0] in reader:
                return Source(names, lambda ts: np.stack([t.T for t in ts]))
        if which != "down_proj" and f"{prefix}.gate_up_proj" in reader:  # HF fused [E, 2F, D], gate first
            sl = slice(0, f) if which == "gate_proj" else slice(f, 2 * f)
            return Source([f"{prefix}.gate_up_proj"], lambda ts, sl=sl: np.transpose(ts[0][:, sl, :], (0, 2, 1)))
        if which == "down_proj" and f"{prefix}.down_proj" in reader:  # HF fused [E, D, F]
            return Source([f"{prefix}.down_proj"], lambda ts: np.transpose(ts[0], (0, 2, 1)))
    return Source([f"model.layers.{layer}.mlp.experts.0.{which}.weight"], lambda ts: ts[0])  # reported missing


def _fp8_param(path: tuple, cfg: HybridConfig, reader: CheckpointFolder) -> tuple[np.ndarray, list[str]]:
    """Kernel or block scales of an FP8-resident projection: the checkpoint's own FP8 blocks when it has them
    (no dequantize-requantize round trip), else the weight quantized to 128 x 128 blocks on load."""
    want_scale = path[-1] == "kernel_scale_inv"
    base = (*path[:-1], "kernel")
    src = _source(base, cfg, reader)
    wname = src.names[0]
    sname = wname + "_scale_inv"
    if wname not in reader:
        return np.zeros(0), [wname]  # reported as missing by the caller
    w = reader[wname]
    if sname in reader and w.dtype == np.dtype(ml_dtypes.float8_e4m3fn):
        return (reader[sname].T if want_scale else w.T), [wname, sname]
    w8, scale = quantize_fp8_blocks(jnp.asarray(src.build([_weight(reader, wname)])))
    return np.asarray(scale if want_scale else w8), [wname]


def read_config(path: str | Path) -> HybridConfig:
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{path}: no config.json")
    try:
        return config_from_hf(json.loads(cfg_path.read_text()))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: invalid JSON ({e})") from None


def _sharding(var: nnx.Variable, mesh: Mesh | None, rules) -> jax.sharding.Sharding | None:
    if mesh is None:
        return None
    return param_sharding(var, mesh, rules)


def abstract_model(config: HybridConfig, dtype, quant: QuantConfig | None = None) -> HybridLM:
    """Shapes only. Projection weights take the quant policy's dtype when it sets one, else `dtype`."""
    quant = quant or QuantConfig()
    param_dtype = None if quant.projection.param_dtype is not None else dtype
    return nnx.eval_shape(lambda: HybridLM(config, dtype=dtype, param_dtype=param_dtype, quant=quant, rngs=nnx.Rngs(0)))


def load_safetensors_model(
    path: str | Path,
    *,
    dtype=jnp.bfloat16,
    mesh: Mesh | None = None,
    quant: QuantConfig | None = None,
    strict: bool = True,
    rules=LOGICAL_AXIS_RULES,
    progress: bool = True,
) -> HybridLM:
    """Build a HybridLM from a Hugging Face folder (see module docstring)."""
    path = Path(path)
    config = read_config(path)
    reader = CheckpointFolder(path)
    graphdef, state = nnx.split(abstract_model(config, dtype, quant))
    flat = list(nnx.to_flat_state(state))
    used: set[str] = set()
    for p, var in tqdm(flat, desc=f"loading {path.name}", unit="tensor", disable=not progress):
        fp8 = p[-1] == "kernel_scale_inv" or (p[-1] == "kernel" and var.get_value().dtype == jnp.float8_e4m3fn)
        if fp8:
            built, names = _fp8_param(p, config, reader)
            src = Source(names, lambda _, built=built: built)
        else:
            src = _source(p, config, reader)
        missing = [n for n in src.names if n not in reader]
        if missing:
            raise CheckpointError(
                f"tensor {missing[0]!r} (for parameter {'.'.join(map(str, p))}) is missing from "
                f"{', '.join(reader.files)} in {path}"
            )
        arr = src.build(None) if fp8 else src.build([_weight(reader, n) for n in src.names])
        want = tuple(var.get_value().shape)
        if tuple(arr.shape) != want:
            raise CheckpointError(
                f"tensor {src.names[0]!r} in {reader.file_of(src.names[0])}: shape {arr.shape} "
                f"does not match the model's {want} for {'.'.join(map(str, p))}"
            )
        used.update(src.names)
        used.update(n + "_scale_inv" for n in src.names)
        target = var.get_value().dtype
        # At most one host copy (cast or transpose); device_put then reads the memory-mapped bytes directly.
        host = np.ascontiguousarray(arr if arr.dtype == target else arr.astype(target))
        var.set_value(jax.device_put(host, _sharding(var, mesh, rules)))
        del host
        del arr
        for n in src.names:  # keep host memory near one tensor, not the whole memory-mapped file
            reader.release(n)
            if n + "_scale_inv" in reader:
                reader.release(n + "_scale_inv")
    extra = sorted(n for n in reader if n not in used and not _IGNORED.match(n) and not _is_mtp(n, config))
    if extra and strict:
        shown = ", ".join(extra[:10]) + (f" and {len(extra) - 10} more" if len(extra) > 10 else "")
        raise CheckpointError(f"{len(extra)} unexpected tensor(s) in {path}: {shown} (strict=False ignores them)")
    return nnx.merge(graphdef, state)


def _is_mtp(name: str, cfg: HybridConfig) -> bool:
    """DeepSeek ships its multi-token-prediction module as layers >= num_layers; inference skips it."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return bool(m) and int(m.group(1)) >= cfg.num_layers


def save_pretrained(model: HybridLM, path: str | Path) -> None:
    """Write our `hybrid` format: config.json (model_type hybrid) + model.safetensors with HF-style names.
    `from_pretrained` reads it back exactly."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    cfg = model.config
    for p, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = np.asarray(jax.device_get(var.get_value()))
        key = ".".join(map(str, p))
        m = re.fullmatch(r"layers\.(\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)", key)
        if m:
            for e in range(cfg.num_experts):
                tensors[f"model.layers.{m.group(1)}.mlp.experts.{e}.{m.group(2)}.weight"] = value[e].T
            continue
        src = _source(p, cfg, {})
        name = src.names[0]
        if name.endswith("_conv1d.weight"):
            value = value.T[:, None, :]
        elif key.endswith((".kernel", ".kernel_scale_inv")):
            value = value.T
        tensors[name] = value
    write_safetensors(path / "model.safetensors", tensors, {"format": "hybrid-jax"})
    (path / "config.json").write_text(json.dumps(config_to_hf(cfg), indent=2) + "\n")


def load_tokenizer(path: str | Path):
    """The folder's `tokenizer.json` as a `tokenizers.Tokenizer`, or None (with a warning) when absent."""
    tok = Path(path) / "tokenizer.json"
    if not tok.is_file():
        warnings.warn(
            f"{path} has no tokenizer.json: pass token ids directly, or a tokenizer object of your own", stacklevel=2
        )
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise ImportError("reading tokenizer.json needs the `tokenizers` package: pip install tokenizers") from e
    return Tokenizer.from_file(str(tok))
