"""Hugging Face `config.json` -> HybridConfig for `kimi_linear`, `deepseek_v32`, `glm5_next`, `qwen3_next`,
`qwen3_5_moe` (text part) and our own `hybrid`.

Every field that changes the math is either mapped or rejected: an unknown field is an error unless it is
listed as having no effect on inference (`_NO_EFFECT`). Every value is type-checked against the HybridConfig
field it becomes (an integer is an integer, not 64.5 or "64"; a flag is true or false), so a malformed file
is a CheckpointError naming the file and field, never a TypeError from deep inside the model.
"""

from __future__ import annotations

import math
import types
import typing
from typing import Any

from checkpoints.safetensors_io import CheckpointError
from hybrid_jax.config import HybridConfig, YarnScaling

SUPPORTED_MODEL_TYPES = (
    "kimi_linear", "deepseek_v32", "glm5_next", "glm5_next_text", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text",
    "hybrid",
)  # fmt: skip
# qwen3_5_moe's top level (the multimodal wrapper): the vision tower and its token ids do not touch text inference
_QWEN35_TOP = {
    "vision_config", "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
}  # fmt: skip
# glm5_next's top level (the multimodal wrapper): the vision tower and its token ids do not touch text inference
_GLM5_TOP = {
    "vision_config", "image_token_id", "video_token_id", "image_start_token_id", "image_end_token_id",
    "video_start_token_id", "video_end_token_id",
}  # fmt: skip

# Fields with no effect on inference numerics (training, bookkeeping, loading hints).
_NO_EFFECT = {
    "architectures", "auto_map", "dtype", "torch_dtype", "transformers_version", "initializer_range",
    "use_cache", "output_router_logits", "router_aux_loss_coef", "pretraining_tp", "attention_dropout",
    "model_type", "tokenizer_class", "_name_or_path", "aux_loss_alpha", "seq_aux", "ep_size",
    "use_return_dict", "return_dict", "output_attentions", "output_hidden_states", "chunk_size_feed_forward",
    "is_encoder_decoder", "tie_encoder_decoder", "id2label", "label2id", "problem_type", "generation_config",
}  # fmt: skip


def _eos(value):
    if isinstance(value, list):
        if not value:
            raise CheckpointError("eos_token_id is an empty list")
        return value[0]
    return value


_HINTS = {cls: typing.get_type_hints(cls) for cls in (HybridConfig, YarnScaling)}


def _matches(value: Any, hint: Any) -> bool:
    """Whether a JSON value fits a HybridConfig / YarnScaling annotation."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return any(_matches(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return type(value) is bool
    if hint is int:
        return type(value) is int
    if hint is float:
        return type(value) in (int, float) and math.isfinite(value)
    if hint is str:
        return isinstance(value, str)
    if typing.get_origin(hint) is tuple:
        return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
    if hint is YarnScaling:
        return isinstance(value, YarnScaling) or (
            isinstance(value, dict)
            and set(value) <= set(_HINTS[YarnScaling])
            and all(_matches(v, _HINTS[YarnScaling][k]) for k, v in value.items())
        )
    return True


def _build(kwargs: dict[str, Any]) -> HybridConfig:
    """HybridConfig(**kwargs) once every value has the type its field declares."""
    hints = _HINTS[HybridConfig]
    unknown = sorted(set(kwargs) - set(hints))
    if unknown:
        raise CheckpointError(f"unknown field(s) {unknown}")
    for name, value in kwargs.items():
        if not _matches(value, hints[name]):
            shown = hints[name] if isinstance(hints[name], type) else str(hints[name]).replace("typing.", "")
            shown = getattr(shown, "__name__", shown)
            raise CheckpointError(f"{name}={value!r} is not of type {shown}")
    for name, value in kwargs.items():  # an integer where a float is declared: store the float
        if type(value) is int and hints[name] in (float, float | None):
            kwargs[name] = float(value)
    try:
        return HybridConfig(**kwargs)
    except (TypeError, ValueError) as e:
        raise CheckpointError(str(e)) from None


class _Fields:
    """Reads fields from a config dict, remembering which were consumed, so leftovers can be rejected."""

    def __init__(self, d: dict[str, Any], model_type: str):
        self.d, self.model_type, self.used = d, model_type, set(_NO_EFFECT)

    def get(self, *names: str, default: Any = None) -> Any:
        self.used.update(names)
        for n in names:
            if n in self.d and self.d[n] is not None:
                return self.d[n]
        return default

    def require(self, *names: str) -> Any:
        value = self.get(*names)
        if value is None:
            raise CheckpointError(f"{self.model_type} config lacks {' / '.join(names)}")
        return value

    def expect(self, name: str, allowed: tuple, default: Any = None) -> Any:
        value = self.get(name, default=default)
        if not any(type(value) is type(a) and value == a for a in allowed):
            raise CheckpointError(f"{name}={value!r} is not supported (supported: {allowed})")
        return value

    def flag(self, *names: str, default: bool) -> bool:
        value = self.get(*names, default=default)
        if type(value) is not bool:
            raise CheckpointError(f"{names[0]}={value!r} is not true or false")
        return value

    def number(self, *names: str, default: Any = None, required: bool = False) -> float:
        value = self.require(*names) if required else self.get(*names, default=default)
        if type(value) not in (int, float) or not math.isfinite(value):
            raise CheckpointError(f"{names[0]}={value!r} is not a number")
        return float(value)

    def check_leftovers(self) -> None:
        extra = sorted(set(self.d) - self.used)
        if extra:
            raise CheckpointError(
                f"{self.model_type}: unknown field(s) {extra} that may change the model's math; refusing to guess"
            )


def _mlp_types(f: _Fields, n: int) -> tuple[str, ...]:
    types = f.get("mlp_layer_types")
    k = f.get("first_k_dense_replace", default=0)
    f.expect("moe_layer_freq", (1,), default=1)
    if types is not None:
        if not isinstance(types, list) or len(types) != n or any(t not in ("dense", "sparse") for t in types):
            raise CheckpointError(f"mlp_layer_types={types!r}: need {n} entries of 'dense' / 'sparse'")
        return tuple("moe" if t == "sparse" else "dense" for t in types)
    if type(k) is not int or not 0 <= k <= n:
        raise CheckpointError(f"first_k_dense_replace={k!r} is not an integer in [0, {n}]")
    return tuple("dense" if i < k else "moe" for i in range(n))


def _common(f: _Fields) -> dict[str, Any]:
    f.expect("hidden_act", ("silu",), default="silu")
    f.expect("attention_bias", (False,), default=False)
    f.expect("mlp_bias", (False,), default=False)
    heads = f.require("num_attention_heads")
    kv_heads = f.get("num_key_value_heads", default=heads)
    if kv_heads != heads:
        raise CheckpointError(
            f"num_key_value_heads={kv_heads} != num_attention_heads={heads}: MLA expands one latent into all heads"
        )
    q_lora = f.get("q_lora_rank")
    return dict(
        vocab_size=f.require("vocab_size"), hidden_size=f.require("hidden_size"),
        num_heads=heads, q_lora_rank=q_lora, kv_lora_rank=f.require("kv_lora_rank"),
        qk_nope_head_dim=f.require("qk_nope_head_dim"), qk_rope_head_dim=f.require("qk_rope_head_dim"),
        v_head_dim=f.require("v_head_dim"), intermediate_size=f.get("intermediate_size", default=0),
        moe_intermediate_size=f.get("moe_intermediate_size", default=0),
        routed_scaling_factor=f.number("routed_scaling_factor", default=1.0),
        topk_group=f.get("topk_group", default=1), rms_norm_eps=f.number("rms_norm_eps", required=True),
        tie_word_embeddings=f.flag("tie_word_embeddings", default=False),
        bos_token_id=f.get("bos_token_id"), eos_token_id=_eos(f.get("eos_token_id")),
        pad_token_id=f.get("pad_token_id"),
    )  # fmt: skip


def _kda_fields(f: _Fields, lac: dict, head_dim: Any, default_heads: int) -> dict[str, Any]:
    """KDA sizes from `linear_attn_config` (released) or the flat `linear_*` fields (transformers' in-tree);
    the forget gate is low rank with rank head_dim (f_a_proj / f_b_proj)."""
    return dict(
        kda_num_heads=lac.get("num_heads", f.get("linear_num_heads", default=default_heads)),
        kda_head_dim=head_dim,
        kda_conv_size=lac.get("short_conv_kernel_size", f.get("linear_conv_kernel_dim", default=4)),
        kda_decay_rank=head_dim,
    )


def _kimi(f: _Fields) -> HybridConfig:
    n = f.require("num_hidden_layers")
    if type(n) is not int or n <= 0:
        raise CheckpointError(f"num_hidden_layers={n!r} is not a positive integer")
    lac = f.get("linear_attn_config", default={})
    if not isinstance(lac, dict):
        raise CheckpointError(f"linear_attn_config={lac!r} is not an object")
    in_tree = f.get("layer_types")
    if in_tree is not None:
        names = {"full_attention": "full", "linear_attention": "linear"}
        if not isinstance(in_tree, list) or len(in_tree) != n or any(str(t) not in names for t in in_tree):
            raise CheckpointError(f"layer_types={in_tree!r}: need {n} of {sorted(names)}")
        types = tuple(names[str(t)] for t in in_tree)
    elif "full_attn_layers" in lac and "kda_layers" in lac:
        types = [None] * n
        for key, kind in (("full_attn_layers", "full"), ("kda_layers", "linear")):
            layers = lac[key]
            if not isinstance(layers, list):
                raise CheckpointError(f"linear_attn_config {key}={layers!r} is not a list of layer numbers")
            for i in layers:  # 1-based in config.json
                if type(i) is not int or not 1 <= i <= n:
                    raise CheckpointError(f"linear_attn_config {key}: layer {i!r} is outside 1..{n} (1-based)")
                if types[i - 1] is not None:
                    raise CheckpointError(
                        f"linear_attn_config: layer {i} is listed twice, or in both full_attn_layers and kda_layers"
                    )
                types[i - 1] = kind
        if None in types:
            raise CheckpointError(
                f"linear_attn_config leaves layers {[i + 1 for i, t in enumerate(types) if t is None]}"
                " (1-based) without a type"
            )
        types = tuple(types)
    else:
        raise CheckpointError("kimi_linear: neither layer_types nor linear_attn_config layer lists")
    known_lac = {
        "full_attn_layers",
        "kda_layers",
        "num_heads",
        "head_dim",
        "short_conv_kernel_size",
        "gate_lower_bound",
        "use_full_rank_gate",
    }
    if set(lac) - known_lac:
        raise CheckpointError(f"linear_attn_config has unknown field(s) {sorted(set(lac) - known_lac)}")
    head_dim = lac.get("head_dim", f.get("linear_head_dim", default=128))
    if f.get("mla_use_nope", default=True) is not True:
        raise CheckpointError(
            "kimi_linear: mla_use_nope=false is not supported (the reference implementation applies no RoPE in MLA)"
        )
    if f.get("rope_scaling") is not None:
        raise CheckpointError("kimi_linear: rope_scaling is set but Kimi-Linear MLA is NoPE")
    f.get("rope_theta", "head_dim", "qk_head_dim", "linear_conv_kernel_dim", "linear_num_heads")  # derived/unused
    if f.get("num_nextn_predict_layers", default=0):
        raise CheckpointError("kimi_linear: multi-token-prediction layers are not supported")
    act = f.get("moe_router_activation_func", default="sigmoid")
    if act not in ("sigmoid", "softmax"):
        raise CheckpointError(f"moe_router_activation_func={act!r} is not supported (sigmoid, softmax)")
    grouped = f.flag("use_grouped_topk", default=True)
    full_rank_gate = lac.get("use_full_rank_gate", False)
    if type(full_rank_gate) is not bool:
        raise CheckpointError(f"linear_attn_config use_full_rank_gate={full_rank_gate!r} is not true or false")
    return _build(dict(
        **_common(f),
        num_layers=n,
        layer_types=types,
        mlp_types=_mlp_types(f, n),
        **_kda_fields(f, lac, head_dim, default_heads=32),
        kda_output_gate_rank=None if full_rank_gate else head_dim,
        kda_gate_lower_bound=lac.get("gate_lower_bound"),
        mla_use_rope=False,
        num_experts=f.get("num_experts", "num_local_experts", default=0),
        num_experts_per_tok=f.get("num_experts_per_token", "num_experts_per_tok", default=0),
        num_shared_experts=f.get("num_shared_experts", "n_shared_experts", default=0),
        n_group=f.get("num_expert_group", "n_group", default=1) if grouped else 1,
        scoring_func=act,
        norm_topk_prob=f.flag("moe_renormalize", "norm_topk_prob", default=True),
        max_position_embeddings=f.get("model_max_length", "max_position_embeddings", default=4096),
    ))  # fmt: skip


def _yarn(f: _Fields) -> tuple[float, YarnScaling | None]:
    rp = f.get("rope_parameters") or f.get("rope_scaling") or {}
    if not isinstance(rp, dict):
        raise CheckpointError(f"rope_parameters / rope_scaling={rp!r} is not an object")
    theta = rp.get("rope_theta", f.get("rope_theta", default=10000.0))
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise CheckpointError(f"rope type {kind!r} is not supported (default, yarn)")
    missing = [k for k in ("factor", "original_max_position_embeddings") if k not in rp]
    if missing:
        raise CheckpointError(f"rope_scaling (yarn) lacks {', '.join(missing)}")
    yarn = dict(
        factor=rp["factor"],
        original_max_position_embeddings=rp["original_max_position_embeddings"],
        beta_fast=rp.get("beta_fast", 32.0),
        beta_slow=rp.get("beta_slow", 1.0),
        mscale=rp.get("mscale", 1.0),
        mscale_all_dim=rp.get("mscale_all_dim", 0.0),
    )
    if not _matches(yarn, YarnScaling):
        raise CheckpointError(f"rope_scaling {rp!r}: factor, mscale... must be numbers, the original length an integer")
    return theta, YarnScaling(
        **{k: v if k == "original_max_position_embeddings" else float(v) for k, v in yarn.items()}
    )


def _deepseek(f: _Fields) -> HybridConfig:
    n = f.require("num_hidden_layers")
    types = f.get("layer_types")
    if type(n) is not int or n <= 0:
        raise CheckpointError(f"num_hidden_layers={n!r} is not a positive integer")
    if types is not None and (not isinstance(types, list) or any(t != "indexed_attention" for t in types)):
        raise CheckpointError(f"deepseek_v32 layer_types={types!r}: only 'indexed_attention' is supported")
    f.expect("scoring_func", ("sigmoid",), default="sigmoid")
    f.expect("topk_method", ("noaux_tc",), default="noaux_tc")
    nextn = f.get("num_nextn_predict_layers", default=0)  # the MTP layers: loaded only with mtp=True
    if type(nextn) is not int or nextn < 0:
        raise CheckpointError(f"num_nextn_predict_layers={nextn!r} is not a non-negative integer")
    f.get("head_dim", "qk_head_dim", "quantization_config")  # derived; FP8 is dequantised at load
    theta, yarn = _yarn(f)
    return _build(dict(
        **_common(f),
        num_layers=n,
        layer_types=("sparse",) * n,
        mlp_types=_mlp_types(f, n),
        mla_use_rope=True,
        mla_rope_interleave=f.flag("rope_interleave", default=True),
        rope_theta=theta,
        rope_scaling=yarn,
        index_num_heads=f.require("index_n_heads"),
        index_head_dim=f.require("index_head_dim"),
        index_rope_dim=f.require("qk_rope_head_dim"),
        index_topk=f.require("index_topk"),
        num_experts=f.get("n_routed_experts", "num_local_experts", "num_experts", default=0),
        num_experts_per_tok=f.get("num_experts_per_tok", default=0),
        num_shared_experts=f.get("n_shared_experts", default=0),
        n_group=f.get("n_group", default=1),
        norm_topk_prob=f.flag("norm_topk_prob", default=True),
        max_position_embeddings=f.get("max_position_embeddings", default=4096),
    ))  # fmt: skip


# transformers 5.23 Glm5NextTextConfig's defaults for the fields the mapping reads: a config.json that leaves one
# out means this value, exactly as transformers reads it
_GLM5_DEFAULTS = {
    "vocab_size": 154880, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 2048,
    "num_hidden_layers": 45, "num_attention_heads": 64, "num_key_value_heads": 64, "n_shared_experts": 1,
    "n_routed_experts": 288, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 0, "v_head_dim": 256, "qk_nope_head_dim": 256, "n_group": 1, "topk_group": 1,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "hidden_act": "silu", "max_position_embeddings": 1048576,
    "rms_norm_eps": 1e-5, "pad_token_id": 154820, "tie_word_embeddings": False, "attention_bias": False,
    "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32, "swiglu_limit": 10.0, "linear_head_dim": 128,
    "linear_num_heads": 64, "linear_conv_kernel_dim": 4, "linear_lower_bound": -5.0, "hc_mult": 4, "hc_eps": 1e-6,
    "hc_sinkhorn_iters": 20, "index_kpool": 16, "index_kpool_always_select_tail": True,
}  # fmt: skip
# transformers keeps these as attributes that no glm5_next module reads
_GLM5_NO_EFFECT = ("first_k_dense_replace", "moe_layer_freq")


def _glm5_text(d: dict[str, Any]) -> dict[str, Any]:
    """The text part of a glm5_next config.json: `text_config` when nested, else the top level (flat)."""
    text = d.get("text_config")
    if text is None:
        return {**_GLM5_DEFAULTS, **{k: v for k, v in d.items() if k not in _GLM5_TOP and k != "text_config"}}
    if not isinstance(text, dict):
        raise CheckpointError(f"text_config={text!r} is not an object")
    extra = sorted(set(d) - _GLM5_TOP - _NO_EFFECT - {"text_config", "tie_word_embeddings"})
    if extra:
        raise CheckpointError(f"glm5_next: unknown top-level field(s) {extra} that may change the model's math")
    top_tie, text_tie = d.get("tie_word_embeddings", False), text.get("tie_word_embeddings", False)
    if top_tie != text_tie:
        raise CheckpointError(f"tie_word_embeddings={top_tie!r} at the top level but {text_tie!r} in text_config")
    return {**_GLM5_DEFAULTS, **text, "model_type": "glm5_next_text"}


def _glm5(f: _Fields) -> HybridConfig:
    """GLM-5.3-Flash (transformers 5.23 `Glm5NextTextConfig`): KDA with a low-rank gate and the safe-gate lower
    bound, NoPE DSA MLA with a KPool indexer, clamped SwiGLU, grouped sigmoid MoE, hyper-connections."""
    n = f.require("num_hidden_layers")
    if type(n) is not int or n <= 0:
        raise CheckpointError(f"num_hidden_layers={n!r} is not a positive integer")
    rope = f.get("qk_rope_head_dim", default=0)
    if rope != 0:
        raise CheckpointError(f"qk_rope_head_dim={rope!r}: the DSA layers of glm5_next are NoPE (0)")
    names = {"linear_attention": "linear", "indexed_attention": "sparse", "full_attention": "sparse"}
    lt = f.get("layer_types")
    if lt is None:
        types = tuple("sparse" if i % 4 == 3 else "linear" for i in range(n))
    elif not isinstance(lt, list) or len(lt) != n or any(str(t) not in names for t in lt):
        raise CheckpointError(f"layer_types={lt!r}: need {n} of {sorted(names)}")
    else:
        types = tuple(names[str(t)] for t in lt)
    it = f.get("indexer_types")
    pattern, freq, offset = (f.get(k) for k in ("index_topk_pattern", "index_topk_freq", "index_skip_topk_offset"))
    if it is None and pattern is not None:
        if isinstance(pattern, str) and set(pattern) <= {"F", "S"}:
            it = [{"F": "full", "S": "shared"}[c] for c in pattern]
        elif isinstance(pattern, list):
            it = pattern
        else:
            raise CheckpointError(f"index_topk_pattern={pattern!r} is not a string of F / S nor a list")
    if it is None:
        freq = 1 if freq is None else freq
        offset = 2 if offset is None else offset
        if type(freq) is not int or type(offset) is not int:
            raise CheckpointError(f"index_topk_freq={freq!r} / index_skip_topk_offset={offset!r} are not integers")
        freq = max(freq, 1)
        it = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    if not isinstance(it, list) or len(it) != n or any(t not in ("full", "shared") for t in it):
        raise CheckpointError(f"indexer_types={it!r}: need {n} of 'full' / 'shared'")
    lac = f.get("linear_attn_config", default={})
    if not isinstance(lac, dict):
        raise CheckpointError(f"linear_attn_config={lac!r} is not an object")
    unknown = sorted(set(lac) - {"head_dim", "num_heads", "short_conv_kernel_size", "gate_lower_bound", "safe_gate"})
    if unknown:
        raise CheckpointError(f"linear_attn_config has unknown field(s) {unknown}")
    head_dim = lac.get("head_dim", f.get("linear_head_dim", default=128))
    f.used.add("linear_lower_bound")  # null is meaningful here (the softplus gate), so read the raw value
    lower = lac.get("gate_lower_bound", f.d.get("linear_lower_bound"))
    if lower is None and lac.get("safe_gate", True) and "linear_attn_config" in f.d:
        lower = -5.0
    f.get("head_dim", "qk_head_dim", "quantization_config", *_GLM5_NO_EFFECT)  # derived / unread; FP8 dequantised
    f.get("rope_parameters", "rope_theta")  # no rotary dims anywhere in the text model (qk_rope_head_dim = 0)
    nextn = f.get("num_nextn_predict_layers", default=0)  # the MTP layers are skipped
    if type(nextn) is not int or nextn < 0:
        raise CheckpointError(f"num_nextn_predict_layers={nextn!r} is not a non-negative integer")
    common = _common(f)
    return _build(dict(
        **common,
        num_layers=n,
        layer_types=types,
        mlp_types=_mlp_types_glm5(f, n),
        **_kda_fields(f, lac, head_dim, default_heads=64),
        kda_output_gate_rank=head_dim,
        kda_gate_lower_bound=None if lower is None else float(lower) if type(lower) in (int, float) else lower,
        mla_use_rope=False,
        mla_norm_eps=common["rms_norm_eps"],  # q_a / kv_a norms take the model's eps here (DeepSeek: 1e-6)
        index_num_heads=f.get("index_n_heads", default=32),
        index_head_dim=f.get("index_head_dim", default=128),
        index_topk=f.get("index_topk", default=2048),
        index_kpool=f.get("index_kpool", default=16),
        index_kpool_always_select_tail=f.flag("index_kpool_always_select_tail", default=True),
        indexer_types=tuple(it),
        num_experts=f.get("n_routed_experts", "num_local_experts", default=0),
        num_experts_per_tok=f.get("num_experts_per_tok", default=0),
        num_shared_experts=f.get("n_shared_experts", default=0),
        n_group=f.get("n_group", default=1),
        norm_topk_prob=f.flag("norm_topk_prob", default=True),
        swiglu_limit=f.get("swiglu_limit"),
        hc_mult=f.get("hc_mult", default=4),
        hc_sinkhorn_iters=f.get("hc_sinkhorn_iters", default=20),
        hc_eps=f.number("hc_eps", default=1e-6),
        max_position_embeddings=f.get("max_position_embeddings", default=1048576),
        page_size=math.lcm(64, kpool) if type(kpool := f.get("index_kpool", default=16)) is int and kpool > 0 else 64,
    ))  # fmt: skip


def _mlp_types_glm5(f: _Fields, n: int) -> tuple[str, ...]:
    """mlp_layer_types, defaulting as glm5_next does: the first min(3, n) layers dense, the rest MoE."""
    types = f.get("mlp_layer_types")
    if types is None:
        return tuple("dense" if i < min(3, n) else "moe" for i in range(n))
    if not isinstance(types, list) or len(types) != n or any(t not in ("dense", "sparse") for t in types):
        raise CheckpointError(f"mlp_layer_types={types!r}: need {n} entries of 'dense' / 'sparse'")
    return tuple("moe" if t == "sparse" else "dense" for t in types)


def _qwen_rope(f: _Fields, head_dim: int, mrope: bool = False) -> tuple[float, int]:
    """(rope_theta, rotary dims) from `rope_parameters` (transformers 5) or the flat `rope_theta` /
    `partial_rotary_factor` / `rope_scaling` of the released files; only the default rope type.

    mrope (qwen3_5): `mrope_section` / `mrope_interleaved` say which of the temporal, height and width positions
    each rotary frequency takes. Text positions are the same on all three axes, so for text they change no angle:
    the rotation is the plain one (transformers: `Qwen3_5TextRotaryEmbedding.recomposition_frequencies`)."""
    rp = f.get("rope_parameters", default={})
    if not isinstance(rp, dict):
        raise CheckpointError(f"rope_parameters={rp!r} is not an object")
    known = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    known |= {"mrope_section", "mrope_interleaved"} if mrope else set()
    unknown = sorted(set(rp) - known)
    if unknown:
        raise CheckpointError(f"rope_parameters has unknown field(s) {unknown}")
    section = rp.get("mrope_section", [11, 11, 10])
    if not isinstance(section, list) or len(section) != 3 or any(type(x) is not int or x < 0 for x in section):
        raise CheckpointError(f"rope_parameters mrope_section={section!r} is not three non-negative integers")
    if type(rp.get("mrope_interleaved", True)) is not bool:
        raise CheckpointError(f"rope_parameters mrope_interleaved={rp['mrope_interleaved']!r} is not true or false")
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind != "default" or f.get("rope_scaling") is not None:
        scaling = f.get("rope_scaling")
        raise CheckpointError(f"rope type {kind!r} / rope_scaling={scaling!r}: only default RoPE is supported")
    theta = rp.get("rope_theta", f.get("rope_theta", default=10000.0))
    factor = rp.get("partial_rotary_factor", f.get("partial_rotary_factor", default=0.25))
    for name, value in (("rope_theta", theta), ("partial_rotary_factor", factor)):
        if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
            raise CheckpointError(f"{name}={value!r} is not a positive number")
    if factor > 1:
        raise CheckpointError(f"partial_rotary_factor={factor!r} is more than 1")
    return float(theta), int(head_dim * factor)  # transformers: int(head_dim * partial_rotary_factor)


def _qwen_layer_types(f: _Fields, n: int) -> tuple[str, ...]:
    names = {"linear_attention": "linear", "full_attention": "attention"}
    lt = f.get("layer_types")
    if lt is None:
        every = f.get("full_attention_interval", default=4)
        if type(every) is not int or every <= 0:
            raise CheckpointError(f"full_attention_interval={every!r} is not a positive integer")
        return tuple("linear" if (i + 1) % every else "attention" for i in range(n))
    f.used.add("full_attention_interval")  # transformers ignores it once layer_types is given
    if not isinstance(lt, list) or len(lt) != n or any(str(t) not in names for t in lt):
        raise CheckpointError(f"layer_types={lt!r}: need {n} of {sorted(names)}")
    return tuple(names[str(t)] for t in lt)


# transformers 5.23 Qwen3NextConfig's defaults for the fields the mapping reads (a config.json that leaves one out
# means this value, as transformers reads it)
_QWEN3_NEXT_DEFAULTS = {
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 48,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "decoder_sparse_step": 1, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 10, "num_experts": 512, "norm_topk_prob": True, "tie_word_embeddings": False,
}  # fmt: skip


# transformers 5.23 Qwen3_5MoeTextConfig's defaults: Qwen3NextConfig's but these, and no dense layers (no
# intermediate_size / decoder_sparse_step / mlp_only_layers / norm_topk_prob: every layer MoE, Top-K renormalised)
_QWEN35_DEFAULTS = {
    **{k: v for k, v in _QWEN3_NEXT_DEFAULTS.items()
       if k not in ("intermediate_size", "decoder_sparse_step", "norm_topk_prob")},
    "vocab_size": 248320, "num_hidden_layers": 40, "num_experts_per_tok": 8, "num_experts": 256,
}  # fmt: skip


def _qwen35_text(d: dict[str, Any]) -> dict[str, Any]:
    """The text part of a qwen3_5_moe config.json (`text_config`), or a flat qwen3_5_moe_text one."""
    if d.get("model_type") == "qwen3_5_moe_text":
        return {**_QWEN35_DEFAULTS, **d}
    text = d.get("text_config", {})
    if not isinstance(text, dict):
        raise CheckpointError(f"text_config={text!r} is not an object")
    extra = sorted(set(d) - _QWEN35_TOP - _NO_EFFECT - {"text_config", "tie_word_embeddings"})
    if extra:
        raise CheckpointError(f"qwen3_5_moe: unknown top-level field(s) {extra} that may change the model's math")
    top_tie, text_tie = d.get("tie_word_embeddings", False), text.get("tie_word_embeddings", False)
    if top_tie != text_tie:
        raise CheckpointError(f"tie_word_embeddings={top_tie!r} at the top level but {text_tie!r} in text_config")
    return {**_QWEN35_DEFAULTS, **text, "model_type": "qwen3_5_moe_text"}


def _qwen3_5_moe(f: _Fields) -> HybridConfig:
    """Qwen3.5-MoE's text model (transformers 5.23 `Qwen3_5MoeTextConfig`): Qwen3-Next's layers with the Gated
    DeltaNet projections split (a loading matter), every FFN MoE, multimodal RoPE sections (plain RoPE for text)."""
    return _qwen3_next(f, qwen35=True)


def _qwen3_next(f: _Fields, qwen35: bool = False) -> HybridConfig:
    """Qwen3-Next (transformers 5.23 `Qwen3NextConfig`): Gated DeltaNet layers (grouped q/k heads, SiLU-gated
    output norm) 3 : 1 with gated GQA (q/k norm, partial RoPE), softmax Top-K MoE with a sigmoid-gated shared
    expert, zero-centred RMSNorm weights. qwen35: Qwen3.5-MoE's text model (`_qwen3_5_moe`)."""
    n = f.require("num_hidden_layers")
    if type(n) is not int or n <= 0:
        raise CheckpointError(f"num_hidden_layers={n!r} is not a positive integer")
    f.expect("hidden_act", ("silu",), default="silu")
    f.expect("attention_bias", (False,), default=False)
    if f.get("use_sliding_window", default=False) is not False:
        raise CheckpointError("use_sliding_window=true is not supported (Qwen's full layers attend to every position)")
    f.get("sliding_window", "max_window_layers")  # read by transformers only with use_sliding_window
    f.get("mtp_num_hidden_layers", "mtp_use_dedicated_embeddings")  # the MTP module (`mtp.*`) is skipped
    f.get("attn_output_gate")  # in some released files; transformers' modules always gate (q_proj is 2x wide)
    heads, hidden, head_dim = f.require("num_attention_heads"), f.require("hidden_size"), f.require("head_dim")
    theta, rope_dim = _qwen_rope(f, head_dim if type(head_dim) is int else 0, mrope=qwen35)
    experts = f.require("num_experts")
    if qwen35:
        mlp = ("moe",) * n
    else:
        step = f.require("decoder_sparse_step")
        only = f.get("mlp_only_layers", default=[])
        if type(step) is not int or step <= 0:
            raise CheckpointError(f"decoder_sparse_step={step!r} is not a positive integer")
        if not isinstance(only, list) or any(type(i) is not int for i in only):
            raise CheckpointError(f"mlp_only_layers={only!r} is not a list of layer indices")
        mlp = tuple("moe" if i not in only and experts > 0 and (i + 1) % step == 0 else "dense" for i in range(n))
    shared = f.require("shared_expert_intermediate_size")
    if type(shared) is not int or shared < 0:
        raise CheckpointError(f"shared_expert_intermediate_size={shared!r} is not a non-negative integer")
    return _build(dict(
        vocab_size=f.require("vocab_size"), hidden_size=hidden, num_layers=n,
        layer_types=_qwen_layer_types(f, n), mlp_types=mlp,
        kda_num_heads=f.require("linear_num_value_heads"), kda_num_k_heads=f.require("linear_num_key_heads"),
        kda_head_dim=f.require("linear_key_head_dim"), kda_v_head_dim=f.require("linear_value_head_dim"),
        kda_conv_size=f.require("linear_conv_kernel_dim"),
        kda_scalar_decay=True, kda_decay_rank=None, kda_output_gate_rank=None, kda_norm_gate="silu",
        num_heads=heads, attn_num_kv_heads=f.require("num_key_value_heads"), attn_head_dim=head_dim,
        attn_rope_dim=rope_dim, rope_theta=theta, attn_output_gate=True, attn_qk_norm=True,
        num_experts=experts, num_experts_per_tok=f.require("num_experts_per_tok"),
        num_shared_experts=1 if shared else 0, shared_expert_intermediate_size=shared or None,
        shared_expert_gate=bool(shared), router_bias=False, scoring_func="softmax",
        norm_topk_prob=True if qwen35 else f.flag("norm_topk_prob", default=True),
        moe_intermediate_size=f.require("moe_intermediate_size"),
        intermediate_size=0 if qwen35 else f.require("intermediate_size"),
        rms_norm_eps=f.number("rms_norm_eps", required=True), norm_zero_centered=True,
        tie_word_embeddings=f.flag("tie_word_embeddings", default=False),
        max_position_embeddings=f.require("max_position_embeddings"),
        bos_token_id=f.get("bos_token_id"), eos_token_id=_eos(f.get("eos_token_id")),
        pad_token_id=f.get("pad_token_id"),
    ))  # fmt: skip


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> HybridConfig:
    """Map a parsed config.json to a HybridConfig; raises CheckpointError, with `source` (the file) and the
    field named, on anything it cannot honour."""
    try:
        return _config_from_hf(d)
    except CheckpointError as e:
        raise CheckpointError(f"{source}: {e}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as e:
        raise CheckpointError(f"{source}: malformed config ({type(e).__name__}: {' '.join(str(e).split())})") from None


def mtp_layers(d: dict[str, Any], cfg: HybridConfig) -> range:
    """The layer indices of a multi-token-prediction module, which inference skips unless loaded with mtp=True
    (none otherwise): DeepSeek's `num_nextn_predict_layers`; glm5_next's at least one (transformers drops
    `layers.{num_hidden_layers}.*`); ours `mtp_layers`."""
    if d.get("model_type") == "hybrid":
        return range(cfg.num_layers, cfg.num_layers + cfg.mtp_layers)
    if d.get("model_type") == "deepseek_v32":
        return range(cfg.num_layers, cfg.num_layers + d.get("num_nextn_predict_layers", 0))
    if d.get("model_type") in ("glm5_next", "glm5_next_text"):
        text = d.get("text_config") if isinstance(d.get("text_config"), dict) else d
        return range(cfg.num_layers, cfg.num_layers + max(1, text.get("num_nextn_predict_layers") or 0))
    return range(0)


def _config_from_hf(d: dict[str, Any]) -> HybridConfig:
    if not isinstance(d, dict):
        raise CheckpointError(f"not a JSON object but {type(d).__name__}")
    model_type = d.get("model_type")
    if not isinstance(model_type, str) or model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"unknown model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if model_type == "hybrid":
        skip = ("model_type", "architectures", "transformers_version", "dtype", "torch_dtype")  # dtype: the weights'
        fields = {k: v for k, v in d.items() if k not in skip}
        return _build(fields)
    if model_type == "glm5_next":
        d = _glm5_text(d)
        model_type = "glm5_next_text"
    if model_type == "qwen3_next":
        d = {**_QWEN3_NEXT_DEFAULTS, **d}
    if model_type in ("qwen3_5_moe", "qwen3_5_moe_text"):
        d = _qwen35_text(d)
        model_type = "qwen3_5_moe_text"
    f = _Fields(d, model_type)
    build = {
        "kimi_linear": _kimi, "deepseek_v32": _deepseek, "glm5_next_text": _glm5, "qwen3_next": _qwen3_next,
        "qwen3_5_moe_text": _qwen3_5_moe,
    }[model_type]  # fmt: skip
    cfg = build(f)
    f.check_leftovers()
    return cfg


def config_to_hf(cfg: HybridConfig) -> dict[str, Any]:
    """Our own `hybrid` config.json: every HybridConfig field, plus model_type."""
    return {"model_type": "hybrid", "architectures": ["HybridLM"], **cfg.to_dict()}
