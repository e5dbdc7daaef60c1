"""`from_pretrained` / `save_pretrained`: Hugging Face folders <-> HybridLM.

Our parameter paths follow the Hugging Face names, so each parameter is found by a rule:
`layers.3.self_attn.q_proj.kernel [in, out]` <- `model.layers.3.self_attn.q_proj.weight [out, in]`, with
a few reshapes (conv kernels, A_log), per-expert tensors stacked into `[E, ...]` (or HF's fused
`gate_up_proj`), `block_sparse_moe` accepted for `mlp`, and FP8 weights with `weight_scale_inv` 128x128
block scales dequantised. Tensors are read one at a time from memory-mapped files and placed directly on
their target sharding, so host memory stays near the size of the largest (stacked) tensor.

Nothing in the folder is trusted: `CheckpointFolder` validates every header and path before a byte of data is
read, and here every tensor must exist, hold floating-point values for a floating-point parameter, have the
parameter's shape, and every tensor of the checkpoint must be used (strict), so a config written for another
checkpoint fails instead of loading a different model.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import warnings
import weakref
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

from checkpoints.hf_config import config_from_hf, config_to_hf, mtp_layers
from checkpoints.safetensors_io import (
    FLOAT_DTYPES,
    CheckpointError,
    CheckpointFolder,
    read_json,
    regular_file,
    resolve_folder,
    resolve_inside,
    write_safetensors,
)
from hybrid_jax.config import HybridConfig
from hybrid_jax.layers.common import quantize_fp8_blocks
from hybrid_jax.model import HybridLM
from hybrid_jax.quant.config import QuantConfig
from sharding.rules import LOGICAL_AXIS_RULES, param_sharding

FP8_BLOCK = 128
# Tensors a checkpoint may carry that inference does not use.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
_VISION = "model.visual."  # glm5_next's / qwen3_5_moe's vision tower: recognised and skipped
_QWEN_MTP = "mtp."  # Qwen3-Next's / 3.5's multi-token-prediction module (transformers ignores `^mtp.*` too)
log = logging.getLogger("hybrid_jax.checkpoints")


@dataclass
class Source:
    """How one parameter is built: the checkpoint tensors it reads and the function combining them."""

    names: list[str]
    build: Callable[[list[np.ndarray]], np.ndarray]


def _t(x: np.ndarray) -> np.ndarray:
    return x.T


def _weight(reader: CheckpointFolder, name: str) -> np.ndarray:
    """A tensor as float32-or-native numpy, FP8 block-scaled weights dequantised (docs/architecture.md §9)."""
    w = reader[name]
    scale_name = name + "_scale_inv" if name.endswith(".weight") else None
    if scale_name and scale_name in reader:
        s = np.asarray(reader[scale_name], np.float32)
        blocks = tuple(-(-n // FP8_BLOCK) for n in w.shape)
        if w.ndim != 2 or s.shape != blocks:
            raise CheckpointError(
                f"tensor {scale_name!r} in {reader.path_of(scale_name)}: shape {s.shape} is not one scale per "
                f"{FP8_BLOCK}x{FP8_BLOCK} block of {name!r} {w.shape}"
            )
        rows, cols = w.shape
        s_full = np.repeat(np.repeat(s, FP8_BLOCK, axis=0)[:rows], FP8_BLOCK, axis=1)[:, :cols]
        return w.astype(np.float32) * s_full
    return w


def _first_present(reader, candidates: list[str]) -> str | None:
    return next((c for c in candidates if c in reader), None)


def prefix_of(reader) -> str:
    """Where a checkpoint keeps the decoder: `model.` (kimi_linear, deepseek_v32, ours) or
    `model.language_model.` (glm5_next, whose `model.visual.*` vision tower inference skips)."""
    return "model.language_model." if "model.language_model.embed_tokens.weight" in reader else "model."


def _source(path: tuple, cfg: HybridConfig, reader: CheckpointFolder, prefix: str = "model.") -> Source:
    """The checkpoint recipe of one parameter path of HybridLM."""
    key = ".".join(map(str, path))
    if key == "embed_tokens.embedding":
        return Source([prefix + "embed_tokens.weight"], lambda t: t[0])
    mtp = re.fullmatch(r"mtp\.(\d+)\.(.+)", key)
    if mtp:  # MTP module j is checkpoint layer num_layers + j; its embedding / head copies fall back on the model's
        layer = f"layers.{cfg.num_layers + int(mtp.group(1))}."
        if mtp.group(2) == "embed_tokens.embedding":
            own = prefix + layer + "embed_tokens.weight"
            return Source([own if own in reader else prefix + "embed_tokens.weight"], lambda t: t[0])
        if mtp.group(2) == "shared_head.head.kernel" and prefix + layer + "shared_head.head.weight" not in reader:
            head = "lm_head.weight" if "lm_head.weight" in reader else prefix + "embed_tokens.weight"  # tied
            return Source([head], lambda t: _t(t[0]))
        return _source((*(layer + mtp.group(2)).split("."),), cfg, reader, prefix)
    hf = key if key.startswith("lm_head.") else prefix + key
    if hf.endswith(".kernel_scale_inv"):  # FP8-resident projection: torch [out/128, in/128] -> ours [in/128, out/128]
        return Source([hf[: -len(".kernel_scale_inv")] + ".weight_scale_inv"], lambda t: t[0].T)
    if hf.endswith(".index_kpool_compress_gate.kernel"):  # a bare torch Parameter [H_I, D], no `.weight`
        return Source([hf[: -len(".kernel")]], lambda t: _t(t[0]))
    if hf.endswith(".kernel"):
        hf = hf[: -len(".kernel")] + ".weight"
    alternatives = [hf]
    if ".mlp." in hf:  # Kimi's released and HF-saved checkpoints call the FFN block_sparse_moe
        alternatives.append(hf.replace(".mlp.", ".block_sparse_moe."))
    # glm5_next as released: `hc_attn_fn` (transformers' modules: `attn_hc.fn`); the KDA forget gate's
    # `self_attn.f_a_proj` (modules: `self_attn.forget_gate.f_a_proj`)
    hc = re.fullmatch(r"(.*\.layers\.\d+\.)(attn|ffn)_hc\.(fn|base|scale)", hf)
    if hc:
        alternatives.append(f"{hc.group(1)}hc_{hc.group(2)}_{hc.group(3)}")
    gate = re.fullmatch(r"(.*\.self_attn\.)(f_a_proj\.weight|f_b_proj\.weight|dt_bias|A_log)", hf)
    if gate:
        alternatives.append(f"{gate.group(1)}forget_gate.{gate.group(2)}")

    if ".mlp.shared_experts." in hf:  # Qwen's single shared expert
        alternatives.append(hf.replace(".mlp.shared_experts.", ".mlp.shared_expert."))
    gdn = re.fullmatch(r"layers\.(\d+)\.self_attn\.(.+)", key)
    if gdn and f"{prefix}layers.{gdn.group(1)}.linear_attn.out_proj.weight" in reader:
        return _gdn_source(f"{prefix}layers.{gdn.group(1)}.linear_attn.", gdn.group(2), cfg, reader)
    m = re.fullmatch(re.escape(prefix) + r"layers\.(\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)", hf)
    if m:
        return _expert_source(int(m.group(1)), m.group(2), cfg, reader, prefix)
    name = _first_present(reader, alternatives) or alternatives[0]
    conv = re.fullmatch(r"(.*\.self_attn\.)([qkv])_conv1d\.weight", name)
    if conv and name not in reader and conv.group(1) + "conv1d.weight" in reader:  # transformers' fused q|k|v conv
        part, c = "qkv".index(conv.group(2)), cfg.kda_dim
        return Source([conv.group(1) + "conv1d.weight"], lambda t: t[0][part * c : (part + 1) * c, 0, :].T)
    if re.search(r"_conv1d\.weight$", name):  # torch [C, 1, W] -> ours [W, C]
        return Source([name], lambda t: t[0].reshape(t[0].shape[0], -1).T)
    if name.endswith(".A_log"):  # stored [1, 1, H, 1] (released) or [H]
        return Source([name], lambda t: t[0].reshape(-1))
    if key.endswith(".kernel") or (hc and hc.group(3) == "fn"):  # hc fn: torch [2N + N², N·D] -> ours [N·D, ...]
        return Source([name], lambda t: _t(t[0]))
    return Source([name], lambda t: t[0])


def _gdn_source(base: str, leaf: str, cfg: HybridConfig, reader: CheckpointFolder) -> Source:
    """A Gated DeltaNet parameter of Qwen's checkpoints (`linear_attn.*`) -> ours (`self_attn.*`, Kimi's names).

    qwen3_next fuses the input projections per key head: `in_proj_qkvz` [N_k (2K + 2rV), D] holds, for each
    key head, its q (K rows), k (K), then the v and z rows of its r = N / N_k value heads (rV each);
    `in_proj_ba` [N_k 2r, D] holds each key head's r β logits, then its r decay inputs. qwen3_5 keeps them
    apart: `in_proj_qkv` [2 N_k K + N V, D] (q | k | v), `in_proj_z`, `in_proj_b`, `in_proj_a`. The conv
    weight [2 N_k K + N V, 1, W] runs over q | k | v in that order either way."""
    nk, n, dk, dv = cfg.kda_k_heads, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_v_dim
    r, c = n // nk, cfg.kda_dim
    rows = {"q": (0, dk), "k": (dk, 2 * dk), "v": (2 * dk, 2 * dk + r * dv), "z": (2 * dk + r * dv, 2 * (dk + r * dv))}
    fused = base + "in_proj_qkvz.weight" in reader
    proj = re.fullmatch(r"([qkvfbg])_proj\.kernel", leaf)
    if proj:
        part = {"f": "a", "g": "z"}.get(proj.group(1), proj.group(1))
        if part in "ba":
            if fused:  # [N_k, 2r, D]: b rows first
                lo = 0 if part == "b" else r
                return Source(
                    [base + "in_proj_ba.weight"], lambda t: t[0].reshape(nk, 2 * r, -1)[:, lo : lo + r].reshape(n, -1).T
                )
            return Source([base + f"in_proj_{part}.weight"], lambda t: t[0].T)
        if fused:
            lo, hi = rows[part]
            return Source(
                [base + "in_proj_qkvz.weight"],
                lambda t: t[0].reshape(nk, 2 * (dk + r * dv), -1)[:, lo:hi].reshape(nk * (hi - lo), -1).T,
            )
        if part == "z":
            return Source([base + "in_proj_z.weight"], lambda t: t[0].T)
        lo, hi = {"q": (0, c), "k": (c, 2 * c), "v": (2 * c, cfg.kda_conv_dim)}[part]
        return Source([base + "in_proj_qkv.weight"], lambda t: t[0][lo:hi].T)
    conv = re.fullmatch(r"([qkv])_conv1d\.kernel", leaf)
    if conv:
        lo, hi = {"q": (0, c), "k": (c, 2 * c), "v": (2 * c, cfg.kda_conv_dim)}[conv.group(1)]
        return Source([base + "conv1d.weight"], lambda t: t[0][lo:hi, 0, :].T)
    names = {"A_log": "A_log", "dt_bias": "dt_bias", "o_norm.weight": "norm.weight", "o_proj.kernel": "out_proj.weight"}
    if leaf not in names:
        return Source([base + leaf], lambda t: t[0])  # reported missing
    return Source([base + names[leaf]], (lambda t: t[0].T) if leaf.endswith(".kernel") else (lambda t: t[0]))


def _expert_source(layer: int, which: str, cfg: HybridConfig, reader: CheckpointFolder, prefix: str) -> Source:
    e, f = cfg.num_experts, cfg.moe_intermediate_size
    kimi_names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    root = prefix
    for block in ("mlp", "block_sparse_moe"):
        prefix = f"{root}layers.{layer}.{block}.experts"
        for per_expert in (which, kimi_names[which]):
            names = [f"{prefix}.{i}.{per_expert}.weight" for i in range(e)]
            if names[0] in reader:
                return Source(names, lambda ts: np.stack([t.T for t in ts]))
        if which != "down_proj" and f"{prefix}.gate_up_proj" in reader:  # HF fused [E, 2F, D], gate first
            sl = slice(0, f) if which == "gate_proj" else slice(f, 2 * f)
            return Source([f"{prefix}.gate_up_proj"], lambda ts, sl=sl: np.transpose(ts[0][:, sl, :], (0, 2, 1)))
        if which == "down_proj" and f"{prefix}.down_proj" in reader:  # HF fused [E, D, F]
            return Source([f"{prefix}.down_proj"], lambda ts: np.transpose(ts[0], (0, 2, 1)))
    return Source([f"{root}layers.{layer}.mlp.experts.0.{which}.weight"], lambda ts: ts[0])  # reported missing


def _fp8_param(path: tuple, cfg: HybridConfig, reader: CheckpointFolder, prefix: str) -> tuple[np.ndarray, list[str]]:
    """Kernel or block scales of an FP8-resident projection: the checkpoint's own FP8 blocks when it has them
    (no dequantize-requantize round trip), else the weight quantized to 128 x 128 blocks on load."""
    want_scale = path[-1] == "kernel_scale_inv"
    base = (*path[:-1], "kernel")
    src = _source(base, cfg, reader, prefix)
    wname = src.names[0]
    sname = wname + "_scale_inv"
    w = reader[wname]
    if sname in reader and w.dtype == np.dtype(ml_dtypes.float8_e4m3fn):
        return (reader[sname].T if want_scale else w.T), [wname, sname]
    w8, scale = quantize_fp8_blocks(jnp.asarray(src.build([_weight(reader, wname)])))
    return np.asarray(scale if want_scale else w8), [wname]


def read_config(path: str | Path) -> HybridConfig:
    return _read_config(resolve_folder(path))[1]


def _read_config(root: Path) -> tuple[dict, HybridConfig]:
    """config.json of the (resolved) folder `root`, which must be a file inside it: (raw dict, HybridConfig)."""
    what = str(root / "config.json")
    if not (root / "config.json").exists() and not (root / "config.json").is_symlink():
        raise CheckpointError(f"{root}: no config.json")
    raw = read_json(regular_file(resolve_inside(root, "config.json"), what), what)
    return raw, config_from_hf(raw, source=what)


def _sharding(var: nnx.Variable, mesh: Mesh | None, rules) -> jax.sharding.Sharding | None:
    if mesh is None:
        return None
    return param_sharding(var, mesh, rules)


def abstract_model(config: HybridConfig, dtype, quant: QuantConfig | None = None) -> HybridLM:
    """Shapes only. Projection weights take the quant policy's dtype when it sets one, else `dtype`."""
    quant = quant or QuantConfig()
    param_dtype = None if quant.projection.param_dtype is not None else dtype
    return nnx.eval_shape(lambda: HybridLM(config, dtype=dtype, param_dtype=param_dtype, quant=quant, rngs=nnx.Rngs(0)))


# Files that travel with the weights: `save_pretrained` and `convert` copy them from the folder a model came from.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
# The folder each loaded model came from (by object, not an attribute: a model's static attributes are part of
# what jit compiles for, and two loads of the same weights must share their compiled code).
LOADED_FROM: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
FLOAT_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "float64": "float32"}


def checkpoint_dtype(root: Path, raw: dict, reader: CheckpointFolder) -> jnp.dtype:
    """The dtype a folder's weights are in: config.json's `dtype` (or the older `torch_dtype`) when it names a
    floating dtype, else the most common floating dtype of its tensors (FP8 block-scaled weights count as
    bfloat16, the dtype they are published for)."""
    for key in ("dtype", "torch_dtype"):
        name = raw.get(key) or (raw.get("text_config") or {}).get(key)
        if isinstance(name, str) and name.removeprefix("torch.") in FLOAT_NAMES:
            return jnp.dtype(FLOAT_NAMES[name.removeprefix("torch.")])
    counts: dict[str, int] = {}
    for n in reader:
        kind = reader.dtype_name(n)
        kind = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float32"}.get(
            kind, "bfloat16" if kind.startswith("F8") else None
        )
        if kind is not None:
            counts[kind] = counts.get(kind, 0) + 1
    if not counts:
        raise CheckpointError(f"{root}: no floating-point tensor to take the dtype from; pass dtype=")
    return jnp.dtype(max(counts, key=counts.get))


def resolve_dtype(dtype, root: Path, raw: dict, reader: CheckpointFolder) -> jnp.dtype:
    """`dtype` as a jnp dtype; "auto" (or None) is the checkpoint's own (`checkpoint_dtype`)."""
    if dtype is None or (isinstance(dtype, str) and dtype == "auto"):
        return checkpoint_dtype(root, raw, reader)
    try:
        return jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype={dtype!r} is not a dtype name (e.g. 'auto', 'bfloat16', 'float32')") from None


def load_safetensors_model(
    path: str | Path,
    *,
    dtype="auto",
    mesh: Mesh | None = None,
    quant: QuantConfig | None = None,
    strict: bool = True,
    rules=LOGICAL_AXIS_RULES,
    progress: bool = True,
    mtp: bool | None = None,
) -> HybridLM:
    """Build a HybridLM from a Hugging Face folder (see module docstring). mtp: load the checkpoint's
    multi-token-prediction layers (`generate(draft="mtp")`) or skip them; None: skip them in a Hugging Face
    checkpoint (as transformers does), keep them in ours."""
    path = Path(path)
    root = resolve_folder(path)
    raw, config = _read_config(root)
    mtp_range = mtp_layers(raw, config)
    n_mtp = len(mtp_range)
    if mtp is None:
        mtp = raw.get("model_type") == "hybrid" and n_mtp > 0
    if mtp and not n_mtp:
        raise CheckpointError(f"{root}: mtp=True, but {root / 'config.json'} declares no multi-token-prediction layer")
    try:
        config = config.replace(mtp_layers=n_mtp if mtp else 0)
    except ValueError as e:
        raise CheckpointError(f"{root / 'config.json'}: mtp=True: {' '.join(str(e).split())}") from None
    reader = CheckpointFolder(root)
    prefix = prefix_of(reader)
    _check_layers(root, config, reader, prefix)
    dtype = resolve_dtype(dtype, root, raw, reader)
    try:
        graphdef, state = nnx.split(abstract_model(config, dtype, quant))
    except (ValueError, TypeError, ZeroDivisionError, AssertionError) as e:
        raise CheckpointError(
            f"{root / 'config.json'}: the model it describes cannot be built with dtype {dtype.name} and this "
            f"quant policy ({' '.join(str(e).split())})"
        ) from None
    flat = list(nnx.to_flat_state(state))
    used: set[str] = set()
    for p, var in tqdm(flat, desc=f"loading {path.name}", unit="tensor", disable=not progress):
        key = ".".join(map(str, p))
        target = var.get_value().dtype
        want = tuple(var.get_value().shape)
        fp8 = p[-1] == "kernel_scale_inv" or (p[-1] == "kernel" and target == jnp.float8_e4m3fn)
        src = _source((*p[:-1], "kernel") if fp8 else p, config, reader, prefix)
        missing = [n for n in src.names if n not in reader]
        if missing:
            raise CheckpointError(
                f"tensor {missing[0]!r} (for parameter {key}) is missing from {', '.join(reader.files)} in {root}"
            )
        for n in src.names + [n + "_scale_inv" for n in src.names if n + "_scale_inv" in reader]:
            if jnp.issubdtype(target, jnp.floating) and reader.dtype_name(n) not in FLOAT_DTYPES:
                raise CheckpointError(
                    f"tensor {n!r} in {reader.path_of(n)}: dtype {reader[n].dtype} cannot hold the floating "
                    f"point parameter {key}"
                )
        try:
            if fp8:
                arr, names = _fp8_param(p, config, reader, prefix)
                src = Source(names, src.build)
            else:
                arr = src.build([_weight(reader, n) for n in src.names])
        except (ValueError, TypeError, IndexError) as e:
            if isinstance(e, CheckpointError):
                raise
            shown = ", ".join(repr(n) for n in src.names[:3]) + (", ..." if len(src.names) > 3 else "")
            raise CheckpointError(
                f"tensor(s) {shown} in {reader.path_of(src.names[0])}: cannot be arranged into "
                f"parameter {key} {want} ({' '.join(str(e).split())})"
            ) from None
        if tuple(arr.shape) != want:
            raise CheckpointError(
                f"tensor {src.names[0]!r} in {reader.path_of(src.names[0])}: shape {arr.shape} "
                f"does not match the model's {want} for {key}"
            )
        used.update(src.names)
        used.update(n + "_scale_inv" for n in src.names)
        # At most one host copy (cast or transpose); device_put then reads the memory-mapped bytes directly.
        host = np.ascontiguousarray(arr if arr.dtype == target else arr.astype(target))
        var.set_value(jax.device_put(host, _sharding(var, mesh, rules)))
        del host
        del arr
        for n in src.names:  # keep host memory near one tensor, not the whole memory-mapped file
            reader.release(n)
            if n + "_scale_inv" in reader:
                reader.release(n + "_scale_inv")
    mtp = mtp_range if not config.mtp_layers else range(0)
    qwen = raw.get("model_type") in ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")
    qwen_mtp = [n for n in reader if n.startswith(_QWEN_MTP)] if qwen else []
    if qwen_mtp:
        log.info("%s: skipping the multi-token-prediction module (%d tensors under mtp.*)", root, len(qwen_mtp))
    skipped = [n for n in reader if n.startswith(_VISION)]
    if skipped:
        log.info(
            "%s: skipping the vision tower (%d tensors under %s*): text inference only", root, len(skipped), _VISION
        )
    extra = sorted(
        n for n in reader
        if n not in used and not _IGNORED.match(n) and not _is_mtp(n, mtp, prefix) and not n.startswith(_VISION)
        and not (qwen_mtp and n.startswith(_QWEN_MTP))
    )  # fmt: skip
    if extra and strict:
        shown = ", ".join(extra[:10]) + (f" and {len(extra) - 10} more" if len(extra) > 10 else "")
        raise CheckpointError(f"{len(extra)} unexpected tensor(s) in {root}: {shown} (strict=False ignores them)")
    model = nnx.merge(graphdef, state)
    LOADED_FROM[model] = root
    return model


def _layer_of(name: str, prefix: str) -> int | None:
    m = re.match(re.escape(prefix) + r"layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def _check_layers(root: Path, config: HybridConfig, reader: CheckpointFolder, prefix: str = "model.") -> None:
    """A config with more layers than the checkpoint holds fails here, before the (abstract) model is built."""
    present = {i for n in reader if (i := _layer_of(n, prefix)) is not None}
    if config.num_layers > 1 + max(present, default=-1):
        raise CheckpointError(
            f"{root / 'config.json'}: {config.num_layers} layers, but {', '.join(reader.files)} hold tensors of "
            f"{1 + max(present, default=-1)} layers ({prefix}layers.N.*)"
        )


def _is_mtp(name: str, mtp: range, prefix: str = "model.") -> bool:
    """DeepSeek and GLM ship a multi-token-prediction module as layers num_layers.. (num_nextn_predict_layers of
    them); inference skips it. Any other layer past num_layers is unexpected."""
    i = _layer_of(name, prefix)
    return i is not None and i in mtp


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
        j = re.fullmatch(r"mtp\.(\d+)\.(.+)", key)
        if j and j.group(2) == "embed_tokens.embedding":
            tensors[f"model.layers.{cfg.num_layers + int(j.group(1))}.embed_tokens.weight"] = value
            continue
        if j:
            key = f"layers.{cfg.num_layers + int(j.group(1))}.{j.group(2)}"
            p = tuple(key.split("."))
        m = re.fullmatch(r"layers\.(\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)", key)
        if m:
            for e in range(cfg.num_experts):
                tensors[f"model.layers.{m.group(1)}.mlp.experts.{e}.{m.group(2)}.weight"] = value[e].T
            continue
        src = _source(p, cfg, {})
        name = src.names[0]
        if name.endswith("_conv1d.weight"):
            value = value.T[:, None, :]
        elif key.endswith((".kernel", ".kernel_scale_inv", "_hc.fn")):
            value = value.T
        tensors[name] = value
    write_safetensors(path / "model.safetensors", tensors, {"format": "hybrid-jax"})
    raw = {**config_to_hf(cfg), "dtype": jnp.dtype(model.dtypes.compute).name}
    (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    source = LOADED_FROM.get(model)
    for f in TOKENIZER_FILES if source is not None else ():
        src = source / f
        if (src.exists() or src.is_symlink()) and not (path / f).exists():
            shutil.copyfile(regular_file(resolve_inside(source, f), str(src)), path / f)


def load_tokenizer(path: str | Path):
    """The folder's `tokenizer.json` as a `tokenizers.Tokenizer`, or None (with a warning) when absent."""
    tok = Path(path) / "tokenizer.json"
    if not tok.exists() and not tok.is_symlink():
        warnings.warn(
            f"{path} has no tokenizer.json: pass token ids directly, or a tokenizer object of your own", stacklevel=2
        )
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise ImportError("reading tokenizer.json needs the `tokenizers` package: pip install tokenizers") from e
    tok = regular_file(resolve_inside(resolve_folder(path), "tokenizer.json"), str(tok))
    try:
        return Tokenizer.from_file(str(tok))
    except Exception as e:  # the tokenizers library raises a bare Exception on a malformed file
        raise CheckpointError(f"{tok}: not a valid tokenizer.json ({' '.join(str(e).split())})") from None
