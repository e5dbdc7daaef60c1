"""Hugging Face `config.json` -> HybridConfig for `kimi_linear`, `deepseek_v32` and our own `hybrid`.

Every field that changes the math is either mapped or rejected: an unknown field is an error unless it is
listed as having no effect on inference (`_NO_EFFECT`).
"""

from __future__ import annotations

from typing import Any

from checkpoints.safetensors_io import CheckpointError
from hybrid_jax.config import HybridConfig, YarnScaling

SUPPORTED_MODEL_TYPES = ("kimi_linear", "deepseek_v32", "hybrid")

# Fields with no effect on inference numerics (training, bookkeeping, loading hints).
_NO_EFFECT = {
    "architectures", "auto_map", "dtype", "torch_dtype", "transformers_version", "initializer_range",
    "use_cache", "output_router_logits", "router_aux_loss_coef", "pretraining_tp", "attention_dropout",
    "model_type", "tokenizer_class", "_name_or_path", "aux_loss_alpha", "seq_aux", "ep_size",
    "use_return_dict", "return_dict", "output_attentions", "output_hidden_states", "chunk_size_feed_forward",
    "is_encoder_decoder", "tie_encoder_decoder", "id2label", "label2id", "problem_type", "generation_config",
}  # fmt: skip


def _eos(value):
    return value[0] if isinstance(value, list) else value


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
            raise CheckpointError(f"{self.model_type} config.json lacks {' / '.join(names)}")
        return value

    def expect(self, name: str, allowed: tuple, default: Any = None) -> Any:
        value = self.get(name, default=default)
        if value not in allowed:
            raise CheckpointError(
                f"{self.model_type} config.json: {name}={value!r} is not supported (supported: {allowed})"
            )
        return value

    def check_leftovers(self) -> None:
        extra = sorted(set(self.d) - self.used)
        if extra:
            raise CheckpointError(
                f"{self.model_type} config.json: unknown field(s) {extra} that may change the "
                "model's math; refusing to guess"
            )


def _mlp_types(f: _Fields, n: int) -> tuple[str, ...]:
    types = f.get("mlp_layer_types")
    k = f.get("first_k_dense_replace", default=0)
    f.expect("moe_layer_freq", (1,), default=1)
    if types is not None:
        bad = [t for t in types if t not in ("dense", "sparse")]
        if bad or len(types) != n:
            raise CheckpointError(f"mlp_layer_types={types!r}: need {n} entries of 'dense' / 'sparse'")
        return tuple("moe" if t == "sparse" else "dense" for t in types)
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
        routed_scaling_factor=float(f.get("routed_scaling_factor", default=1.0)),
        topk_group=f.get("topk_group", default=1), rms_norm_eps=float(f.require("rms_norm_eps")),
        tie_word_embeddings=bool(f.get("tie_word_embeddings", default=False)),
        bos_token_id=f.get("bos_token_id"), eos_token_id=_eos(f.get("eos_token_id")),
        pad_token_id=f.get("pad_token_id"),
    )  # fmt: skip


def _kimi(f: _Fields) -> HybridConfig:
    n = f.require("num_hidden_layers")
    lac = dict(f.get("linear_attn_config", default={}))
    in_tree = f.get("layer_types")
    if in_tree is not None:
        names = {"full_attention": "full", "linear_attention": "linear"}
        if len(in_tree) != n or any(t not in names for t in in_tree):
            raise CheckpointError(f"layer_types={in_tree!r}: need {n} of {sorted(names)}")
        types = tuple(names[t] for t in in_tree)
    elif "full_attn_layers" in lac and "kda_layers" in lac:
        types = [None] * n
        for i in lac["full_attn_layers"]:  # 1-based in config.json
            types[i - 1] = "full"
        for i in lac["kda_layers"]:
            types[i - 1] = "linear"
        if None in types:
            raise CheckpointError(
                f"linear_attn_config leaves layers {[i + 1 for i, t in enumerate(types) if t is None]}"
                " (1-based) without a type"
            )
        types = tuple(types)
    else:
        raise CheckpointError("kimi_linear config.json has neither layer_types nor linear_attn_config layer lists")
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
            "kimi_linear config.json: mla_use_nope=false is not supported (the reference "
            "implementation applies no RoPE in MLA)"
        )
    if f.get("rope_scaling") is not None:
        raise CheckpointError("kimi_linear config.json: rope_scaling is set but Kimi-Linear MLA is NoPE")
    f.get("rope_theta", "head_dim", "qk_head_dim", "linear_conv_kernel_dim", "linear_num_heads")  # derived/unused
    if f.get("num_nextn_predict_layers", default=0):
        raise CheckpointError("kimi_linear config.json: multi-token-prediction layers are not supported")
    act = f.get("moe_router_activation_func", default="sigmoid")
    if act not in ("sigmoid", "softmax"):
        raise CheckpointError(f"moe_router_activation_func={act!r} is not supported (sigmoid, softmax)")
    grouped = f.get("use_grouped_topk", default=True)
    return HybridConfig(
        **_common(f),
        num_layers=n,
        layer_types=types,
        mlp_types=_mlp_types(f, n),
        kda_num_heads=lac.get("num_heads", f.get("linear_num_heads", default=32)),
        kda_head_dim=head_dim,
        kda_conv_size=lac.get("short_conv_kernel_size", f.get("linear_conv_kernel_dim", default=4)),
        kda_decay_rank=head_dim,
        kda_output_gate_rank=None if lac.get("use_full_rank_gate") else head_dim,
        kda_gate_lower_bound=lac.get("gate_lower_bound"),
        mla_use_rope=False,
        num_experts=f.get("num_experts", "num_local_experts", default=0),
        num_experts_per_tok=f.get("num_experts_per_token", "num_experts_per_tok", default=0),
        num_shared_experts=f.get("num_shared_experts", "n_shared_experts", default=0),
        n_group=f.get("num_expert_group", "n_group", default=1) if grouped else 1,
        scoring_func=act,
        norm_topk_prob=bool(f.get("moe_renormalize", "norm_topk_prob", default=True)),
        max_position_embeddings=f.get("model_max_length", "max_position_embeddings", default=4096),
    )


def _yarn(f: _Fields) -> tuple[float, YarnScaling | None]:
    rp = f.get("rope_parameters") or f.get("rope_scaling") or {}
    theta = float(rp.get("rope_theta", f.get("rope_theta", default=10000.0)))
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise CheckpointError(f"rope type {kind!r} is not supported (default, yarn)")
    return theta, YarnScaling(
        factor=float(rp["factor"]),
        original_max_position_embeddings=int(rp["original_max_position_embeddings"]),
        beta_fast=float(rp.get("beta_fast", 32.0)),
        beta_slow=float(rp.get("beta_slow", 1.0)),
        mscale=float(rp.get("mscale", 1.0)),
        mscale_all_dim=float(rp.get("mscale_all_dim", 0.0)),
    )


def _deepseek(f: _Fields) -> HybridConfig:
    n = f.require("num_hidden_layers")
    types = f.get("layer_types")
    if types is not None and any(t != "indexed_attention" for t in types):
        raise CheckpointError(f"deepseek_v32 layer_types={types!r}: only 'indexed_attention' is supported")
    f.expect("scoring_func", ("sigmoid",), default="sigmoid")
    f.expect("topk_method", ("noaux_tc",), default="noaux_tc")
    f.get("num_nextn_predict_layers", "head_dim", "qk_head_dim", "quantization_config")  # MTP skipped; FP8 at load
    theta, yarn = _yarn(f)
    return HybridConfig(
        **_common(f),
        num_layers=n,
        layer_types=("sparse",) * n,
        mlp_types=_mlp_types(f, n),
        mla_use_rope=True,
        mla_rope_interleave=bool(f.get("rope_interleave", default=True)),
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
        norm_topk_prob=bool(f.get("norm_topk_prob", default=True)),
        max_position_embeddings=f.get("max_position_embeddings", default=4096),
    )


def config_from_hf(d: dict[str, Any]) -> HybridConfig:
    """Map a parsed config.json to a HybridConfig; raises CheckpointError on anything it cannot honour."""
    model_type = d.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"unknown model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if model_type == "hybrid":
        fields = {k: v for k, v in d.items() if k not in ("model_type", "architectures", "transformers_version")}
        try:
            return HybridConfig.from_dict(fields)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"hybrid config.json: {e}") from None
    f = _Fields(d, model_type)
    try:
        cfg = _kimi(f) if model_type == "kimi_linear" else _deepseek(f)
    except ValueError as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{model_type} config.json maps to an invalid HybridConfig: {e}") from None
    f.check_leftovers()
    return cfg


def config_to_hf(cfg: HybridConfig) -> dict[str, Any]:
    """Our own `hybrid` config.json: every HybridConfig field, plus model_type."""
    return {"model_type": "hybrid", "architectures": ["HybridLM"], **cfg.to_dict()}
