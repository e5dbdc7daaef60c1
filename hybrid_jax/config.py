"""Model configuration: one frozen, self-validating dataclass for the whole hybrid family.

Dimension letters used across the project (shape comments and einsum strings):
B batch, T query time, S key time, D model, F ffn, N query heads, K key dim (or kv heads), H head dim,
V value dim, E experts, C chunk, L latent (kv_lora_rank), R rope dims, P pages, G page size.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

LAYER_TYPES = ("linear", "full", "sparse", "attention")
NORM_GATES = ("sigmoid", "silu")
MLP_TYPES = ("dense", "moe")
SCORING_FUNCS = ("sigmoid", "softmax")


def _fail(field: str, value: Any, why: str) -> None:
    raise ValueError(f"HybridConfig.{field}={value!r}: {why}")


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling (DeepSeek-V3 style; docs/architecture.md §5)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def __post_init__(self):
        if not self.factor >= 1.0:
            raise ValueError(f"YarnScaling.factor={self.factor!r}: must be >= 1")
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                f"YarnScaling.original_max_position_embeddings={self.original_max_position_embeddings!r}: "
                "must be positive"
            )
        if not self.beta_fast > self.beta_slow > 0:
            raise ValueError(
                f"YarnScaling beta_fast={self.beta_fast!r}, beta_slow={self.beta_slow!r}: "
                "need beta_fast > beta_slow > 0"
            )


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    """Architecture of a hybrid KDA / (sparse) MLA / AttnRes / MoE decoder.

    `layer_types[i]` is `linear` (KDA / Gated DeltaNet), `full` (dense MLA), `sparse` (MLA over the lightning
    indexer's Top-K) or `attention` (gated GQA with a paged K/V cache, Qwen3-Next); `mlp_types[i]` is `dense`
    (SwiGLU) or `moe`. Layer lists are 0-based (HF config files are
    1-based; the checkpoint loader converts).
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    mlp_types: tuple[str, ...]
    # KDA / Gated DeltaNet (docs/architecture.md §2)
    kda_num_heads: int = 0
    kda_head_dim: int = 0
    kda_conv_size: int = 4
    kda_decay_rank: int | None = None  # rank of the low-rank forget gate (f_a/f_b); None = full rank f_proj
    kda_output_gate_rank: int | None = None  # rank of g_a/g_b; None = full rank g_proj
    kda_scalar_decay: bool = False  # True = Gated DeltaNet: one decay per head instead of per channel
    kda_gate_lower_bound: float | None = None  # "safe gate" g = lb * sigmoid(exp(A_log) * (f + dt_bias))
    kda_chunk_size: int = 64
    # Gated DeltaNet grouping (Qwen3-Next / Qwen3.5): q and k have `kda_num_k_heads` heads, each serving
    # kda_num_heads / kda_num_k_heads consecutive value heads; the recurrence runs over the kda_num_heads value
    # heads of width `kda_v_head_dim`. None = as many / as wide as the value heads (Kimi).
    kda_num_k_heads: int | None = None
    kda_v_head_dim: int | None = None
    kda_norm_gate: str = "sigmoid"  # the output gate of the gated RMSNorm: sigmoid (Kimi) or silu (Qwen)
    # MLA (docs/architecture.md §5)
    num_heads: int = 0
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    mla_use_rope: bool = True  # False = NoPE (Kimi-Linear): the shared 64-d key part is not rotated
    mla_rope_interleave: bool = True  # DeepSeek rotates adjacent pairs (2i, 2i+1)
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None
    mla_output_gate: bool = False  # o = o * sigmoid(W_og x) before o_proj (Kimi K3 gated MLA)
    mla_norm_eps: float = 1e-6  # q_a_layernorm / kv_a_layernorm use the module default, not rms_norm_eps
    # Gated GQA ("attention" layers, docs/architecture.md §5b): num_heads query heads over attn_num_kv_heads
    # key/value heads of attn_head_dim; RoPE (half-split pairs) on the first attn_rope_dim dims of q and k
    attn_num_kv_heads: int = 0
    attn_head_dim: int = 0
    attn_rope_dim: int = 0
    attn_output_gate: bool = True  # q_proj also yields a per-head gate: o ← o ⊙ σ(gate) before o_proj
    attn_qk_norm: bool = True  # RMSNorm over each q / k head before RoPE
    # Lightning indexer (docs/architecture.md §6)
    index_num_heads: int = 0
    index_head_dim: int = 0
    index_rope_dim: int = 0  # rotary dims at the *front* of each indexer head (half-split pairing)
    index_topk: int = 0
    index_norm_eps: float = 1e-6
    # KPool indexer (GLM-5.3-Flash): keys compressed per group of `index_kpool` tokens, Top-(index_topk / kpool)
    # pools scored; 1 = per-token keys (DeepSeek). The incomplete tail pool is always read when `..._tail`.
    index_kpool: int = 1
    index_kpool_always_select_tail: bool = True
    # per layer "full" (run the indexer) or "shared" (reuse the selection of the full sparse layer right before:
    # no indexer weights, no indexer cache); None = every sparse layer full. Non-sparse layers' entries are ignored.
    indexer_types: tuple[str, ...] | None = None
    # MoE (docs/architecture.md §8)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    num_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    scoring_func: str = "sigmoid"
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    moe_intermediate_size: int = 0
    intermediate_size: int = 0  # dense SwiGLU layers
    # Clamped SwiGLU (GLM-5.3-Flash): gate ← min(gate, limit), up ← clip(up, −limit, limit) before SiLU(gate)·up,
    # in dense, shared and routed experts; None = plain SwiGLU
    swiglu_limit: float | None = None
    # Qwen-style MoE: the shared expert's own width (None = moe_intermediate_size x num_shared_experts) and its
    # output scaled by σ(W_sg x) per token; router_bias False = no selection bias (plain softmax / sigmoid Top-K)
    shared_expert_intermediate_size: int | None = None
    shared_expert_gate: bool = False
    router_bias: bool = True
    # Block Attention Residuals (docs/architecture.md §7): decoder layers per block; None = plain residuals
    attn_res_block_size: int | None = None
    # Multi-stream hyper-connections (mHC, docs/architecture.md §7): `hc_mult` residual streams mixed around each
    # mixer and FFN by Sinkhorn-normalised matrices; None = one residual stream
    hc_mult: int | None = None
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-5
    # RMSNorm weights stored zero-centred: y = (1 + w) ⊙ x̂, applied in float32 before the cast (Qwen3-Next);
    # every RMSNorm except the KDA output's gated one
    norm_zero_centered: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    page_size: int = 64  # tokens per page of the paged MLA / indexer caches
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    # Multi-token prediction (DeepSeek-V3's MTP, the drafter of `generate(draft="mtp")`): `mtp_layers` extra
    # modules after the decoder, each one decoder layer of `mtp_layer_type` / `mtp_mlp_type` fed
    # eh_proj([enorm(embed(t_{p+1})); hnorm(h_p)]) (docs/speculative.md). 0 = none. Plain residuals only.
    mtp_layers: int = 0
    mtp_layer_type: str = "sparse"
    mtp_mlp_type: str = "moe"

    def __post_init__(self):
        for name in ("layer_types", "mlp_types", "indexer_types"):
            value = getattr(self, name)
            if value is None and name == "indexer_types":
                continue
            if isinstance(value, str) or not isinstance(value, Sequence):
                _fail(name, value, "must be a sequence of strings")
            object.__setattr__(self, name, tuple(value))
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", YarnScaling(**self.rope_scaling))
        self._validate()

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "page_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                _fail(name, getattr(self, name), "must be positive")
        if len(self.layer_types) != self.num_layers:
            _fail("layer_types", self.layer_types, f"has {len(self.layer_types)} entries, num_layers={self.num_layers}")
        if len(self.mlp_types) != self.num_layers:
            _fail("mlp_types", self.mlp_types, f"has {len(self.mlp_types)} entries, num_layers={self.num_layers}")
        for i, t in enumerate(self.layer_types):
            if t not in LAYER_TYPES:
                _fail(f"layer_types[{i}]", t, f"must be one of {LAYER_TYPES}")
        for i, t in enumerate(self.mlp_types):
            if t not in MLP_TYPES:
                _fail(f"mlp_types[{i}]", t, f"must be one of {MLP_TYPES}")

        if "linear" in self.layer_types:
            for name in ("kda_num_heads", "kda_head_dim", "kda_conv_size", "kda_chunk_size"):
                if getattr(self, name) <= 0:
                    _fail(name, getattr(self, name), "must be positive when the model has linear (KDA) layers")
            for name in ("kda_decay_rank", "kda_output_gate_rank"):
                rank = getattr(self, name)
                if rank is not None and rank <= 0:
                    _fail(name, rank, "must be positive or None (full rank)")
            if self.kda_scalar_decay and self.kda_decay_rank is not None:
                _fail(
                    "kda_decay_rank",
                    self.kda_decay_rank,
                    "the scalar-decay (Gated DeltaNet) gate is full rank; use None",
                )
            lb = self.kda_gate_lower_bound
            if lb is not None and not (-5.0 <= lb < 0.0):
                _fail("kda_gate_lower_bound", lb, "must lie in [-5, 0)")
            nk = self.kda_num_k_heads
            if nk is not None and (nk <= 0 or self.kda_num_heads % nk):
                _fail("kda_num_k_heads", nk, f"must be positive and divide kda_num_heads={self.kda_num_heads}")
            if self.kda_v_head_dim is not None and self.kda_v_head_dim <= 0:
                _fail("kda_v_head_dim", self.kda_v_head_dim, "must be positive or None (= kda_head_dim)")
            if not self.kda_scalar_decay and (self.kda_k_heads != self.kda_num_heads):
                _fail("kda_num_k_heads", nk, "grouped q/k heads need the scalar (Gated DeltaNet) decay")
            if self.kda_norm_gate not in NORM_GATES:
                _fail("kda_norm_gate", self.kda_norm_gate, f"must be one of {NORM_GATES}")

        if any(t in ("full", "sparse") for t in self.layer_types):
            for name in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
                if getattr(self, name) <= 0:
                    _fail(name, getattr(self, name), "must be positive when the model has MLA layers")
            if self.qk_rope_head_dim < 0 or self.qk_rope_head_dim % 2:
                _fail("qk_rope_head_dim", self.qk_rope_head_dim, "must be a non-negative even number")
            if self.q_lora_rank is not None and self.q_lora_rank <= 0:
                _fail("q_lora_rank", self.q_lora_rank, "must be positive or None (no query LoRA)")
            if self.rope_scaling is not None and not self.mla_use_rope:
                _fail("rope_scaling", self.rope_scaling, "is set but mla_use_rope=False (NoPE)")

        if "attention" in self.layer_types:
            for name in ("num_heads", "attn_num_kv_heads", "attn_head_dim"):
                if getattr(self, name) <= 0:
                    _fail(name, getattr(self, name), "must be positive when the model has attention layers")
            if self.num_heads % self.attn_num_kv_heads:
                _fail("attn_num_kv_heads", self.attn_num_kv_heads, f"must divide num_heads={self.num_heads}")
            r = self.attn_rope_dim
            if r < 0 or r % 2 or r > self.attn_head_dim:
                _fail("attn_rope_dim", r, f"must be even and in [0, attn_head_dim={self.attn_head_dim}]")
            if self.rope_scaling is not None:
                _fail("rope_scaling", self.rope_scaling, "YaRN is implemented for MLA only, not attention layers")

        if "sparse" in self.layer_types:
            for name in ("index_num_heads", "index_head_dim", "index_topk"):
                if getattr(self, name) <= 0:
                    _fail(name, getattr(self, name), "must be positive when the model has sparse layers")
            if self.index_rope_dim < 0 or self.index_rope_dim % 2 or self.index_rope_dim > self.index_head_dim:
                _fail(
                    "index_rope_dim",
                    self.index_rope_dim,
                    f"must be even and in [0, index_head_dim={self.index_head_dim}]",
                )
            if self.index_kpool < 1:
                _fail("index_kpool", self.index_kpool, "must be >= 1")
            if self.index_topk % self.index_kpool:
                _fail("index_topk", self.index_topk, f"must be a multiple of index_kpool={self.index_kpool}")
            if self.page_size % self.index_kpool:
                _fail("page_size", self.page_size, f"must be a multiple of index_kpool={self.index_kpool}")
            if self.index_kpool > 1 and self.index_rope_dim:
                _fail("index_rope_dim", self.index_rope_dim, "pooled indexer keys (index_kpool > 1) carry no RoPE")
        if self.indexer_types is not None:
            if len(self.indexer_types) != self.num_layers:
                _fail(
                    "indexer_types",
                    self.indexer_types,
                    f"has {len(self.indexer_types)} entries, num_layers={self.num_layers}",
                )
            for i, (lt, it) in enumerate(zip(self.layer_types, self.indexer_types, strict=True)):
                if it not in ("full", "shared"):
                    _fail(f"indexer_types[{i}]", it, "must be 'full' or 'shared'")
                # transformers hands a selection only to the very next layer
                if lt == "sparse" and it == "shared" and not (i and self.layer_types[i - 1] == "sparse"
                                                              and self.indexer_types[i - 1] == "full"):  # fmt: skip
                    _fail(f"indexer_types[{i}]", it, "a shared sparse layer must follow a full sparse layer")

        if "moe" in self.mlp_types:
            for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
                if getattr(self, name) <= 0:
                    _fail(name, getattr(self, name), "must be positive when the model has MoE layers")
            if self.num_experts_per_tok > self.num_experts:
                _fail("num_experts_per_tok", self.num_experts_per_tok, f"exceeds num_experts={self.num_experts}")
            if self.num_shared_experts < 0:
                _fail("num_shared_experts", self.num_shared_experts, "must be >= 0")
            if self.n_group <= 0 or self.num_experts % self.n_group:
                _fail("n_group", self.n_group, f"must divide num_experts={self.num_experts}")
            if not 0 < self.topk_group <= self.n_group:
                _fail("topk_group", self.topk_group, f"must be in [1, n_group={self.n_group}]")
            per_group = self.num_experts // self.n_group
            if self.n_group > 1 and per_group < 2:
                _fail(
                    "n_group",
                    self.n_group,
                    "grouped routing scores each group by its top-2 experts; need >= 2 per group",
                )
            if self.topk_group * per_group < self.num_experts_per_tok:
                _fail(
                    "num_experts_per_tok",
                    self.num_experts_per_tok,
                    f"more than the {self.topk_group * per_group} experts in the kept groups",
                )
            if self.scoring_func not in SCORING_FUNCS:
                _fail("scoring_func", self.scoring_func, f"must be one of {SCORING_FUNCS}")
            se = self.shared_expert_intermediate_size
            if se is not None and (se <= 0 or not self.num_shared_experts):
                _fail("shared_expert_intermediate_size", se, "must be positive, with num_shared_experts >= 1")
            if self.shared_expert_gate and not self.num_shared_experts:
                _fail("shared_expert_gate", True, "needs a shared expert (num_shared_experts >= 1)")
        if self.swiglu_limit is not None and not (0 < self.swiglu_limit < math.inf):
            _fail("swiglu_limit", self.swiglu_limit, "must be a finite positive number or None (no clamp)")
        if "dense" in self.mlp_types and self.intermediate_size <= 0:
            _fail("intermediate_size", self.intermediate_size, "must be positive when the model has dense MLP layers")

        if self.attn_res_block_size is not None and self.attn_res_block_size <= 0:
            _fail("attn_res_block_size", self.attn_res_block_size, "must be positive or None (AttnRes off)")
        if self.hc_mult is not None:
            if self.hc_mult < 1:
                _fail("hc_mult", self.hc_mult, "must be >= 1 or None (one residual stream)")
            if self.attn_res_block_size is not None:
                _fail("hc_mult", self.hc_mult, "hyper-connections and Block AttnRes are two residual schemes; pick one")
            if self.hc_sinkhorn_iters < 1:
                _fail("hc_sinkhorn_iters", self.hc_sinkhorn_iters, "must be >= 1")
            if not self.hc_eps >= 0:
                _fail("hc_eps", self.hc_eps, "must be >= 0")
        if self.mtp_layers:
            self._validate_mtp()
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            tok = getattr(self, name)
            if tok is not None and not 0 <= tok < self.vocab_size:
                _fail(name, tok, f"outside the vocabulary [0, {self.vocab_size})")

    def _validate_mtp(self) -> None:
        if not isinstance(self.mtp_layers, int) or isinstance(self.mtp_layers, bool) or self.mtp_layers < 0:
            _fail("mtp_layers", self.mtp_layers, "must be a non-negative int")
        if self.mtp_layer_type not in ("full", "sparse", "attention"):
            _fail("mtp_layer_type", self.mtp_layer_type, "must be full, sparse or attention (rolled back by length)")
        if self.mtp_mlp_type not in MLP_TYPES:
            _fail("mtp_mlp_type", self.mtp_mlp_type, f"must be one of {MLP_TYPES}")
        if self.hc_mult is not None or self.attn_res_block_size is not None:
            _fail("mtp_layers", self.mtp_layers, "multi-token prediction takes plain residuals (no hc_mult / AttnRes)")
        if self.mtp_layer_type == "sparse" and self.index_kpool > 1:
            _fail("mtp_layers", self.mtp_layers, f"a sparse MTP layer with index_kpool={self.index_kpool} > 1")
        self.mtp_config()  # the MTP block's own checks (its layer's sizes)

    def mtp_config(self) -> HybridConfig:
        """The one-layer config an MTP module's decoder layer is built from (no indexer sharing, no MTP)."""
        return self.replace(
            num_layers=1, layer_types=(self.mtp_layer_type,), mlp_types=(self.mtp_mlp_type,), indexer_types=None,
            mtp_layers=0,
        )  # fmt: skip

    # ------------------------------------------------------------------ derived sizes
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kda_k_heads(self) -> int:
        """Heads of the KDA / GDN queries and keys (kda_num_k_heads, else one per value head)."""
        return self.kda_num_k_heads or self.kda_num_heads

    @property
    def kda_v_dim(self) -> int:
        """Width of one KDA / GDN value head (kda_v_head_dim, else kda_head_dim)."""
        return self.kda_v_head_dim or self.kda_head_dim

    @property
    def kda_dim(self) -> int:
        """Width of the KDA q (and k) projection: q/k heads x key head dim."""
        return self.kda_k_heads * self.kda_head_dim

    @property
    def kda_value_dim(self) -> int:
        """Width of the KDA v projection (and the output gate): value heads x value head dim."""
        return self.kda_num_heads * self.kda_v_dim

    @property
    def kda_conv_dim(self) -> int:
        """Channels of the short conv and its cached tail: q | k | v."""
        return 2 * self.kda_dim + self.kda_value_dim

    @property
    def shared_expert_width(self) -> int:
        return self.shared_expert_intermediate_size or self.moe_intermediate_size * self.num_shared_experts

    @property
    def latent_dim(self) -> int:
        """Width of one cached MLA token: compressed latent + shared rope key (576 for DeepSeek)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """MLA logit scale: qk_head_dim^-1/2, times YaRN mscale^2 when scaling is on (docs/architecture.md §5)."""
        scale = self.qk_head_dim**-0.5
        rs = self.rope_scaling
        if rs is not None and rs.mscale_all_dim:
            m = yarn_mscale(rs.factor, rs.mscale_all_dim)
            scale *= m * m
        return scale

    @property
    def layer_pattern(self) -> str:
        """One letter per layer: L linear, F full, S sparse, A attention (upper case = MoE FFN)."""
        letters = {"linear": "l", "full": "f", "sparse": "s", "attention": "a"}
        return "".join(
            letters[t].upper() if m == "moe" else letters[t]
            for t, m in zip(self.layer_types, self.mlp_types, strict=True)
        )

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layer_types"] = list(self.layer_types)
        d["mlp_types"] = list(self.mlp_types)
        if self.indexer_types is not None:
            d["indexer_types"] = list(self.indexer_types)
        return d

    def shares_indexer(self, i: int) -> bool:
        """Layer i is sparse and reuses the selection of layer i - 1, a full sparse layer (`indexer_types`)."""
        return self.layer_types[i] == "sparse" and self.indexer_types is not None and self.indexer_types[i] == "shared"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HybridConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"HybridConfig: unknown field(s) {unknown}")
        return cls(**d)

    @classmethod
    def from_json(cls, path: str | Path) -> HybridConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def replace(self, **changes: Any) -> HybridConfig:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ presets
    @classmethod
    def tiny(cls) -> HybridConfig:
        """Every feature present, small enough to run on a CPU in seconds.

        Layers: KDA, KDA, sparse MLA, full MLA, KDA, sparse MLA; layer 0 dense MLP, the rest MoE with grouped
        routing; q-LoRA, YaRN RoPE, MLA output gate, indexer RoPE and Block AttnRes (2 layers per block).
        Vocabulary: 256 bytes + BOS/EOS/PAD of the byte tokenizer, padded to 288.
        """
        return cls(
            vocab_size=288,
            hidden_size=64,
            num_layers=6,
            layer_types=("linear", "linear", "sparse", "full", "linear", "sparse"),
            mlp_types=("dense", "moe", "moe", "moe", "moe", "moe"),
            kda_num_heads=2,
            kda_head_dim=16,
            kda_conv_size=4,
            kda_decay_rank=16,
            kda_output_gate_rank=16,
            kda_chunk_size=8,
            num_heads=4,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            mla_use_rope=True,
            rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=1.0),
            mla_output_gate=True,
            index_num_heads=4,
            index_head_dim=32,
            index_rope_dim=8,
            index_topk=8,
            num_experts=8,
            num_experts_per_tok=2,
            num_shared_experts=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            moe_intermediate_size=32,
            intermediate_size=128,
            attn_res_block_size=2,
            rms_norm_eps=1e-5,
            max_position_embeddings=1024,
            page_size=8,
            bos_token_id=256,
            eos_token_id=257,
            pad_token_id=258,
        )

    @classmethod
    def recall(cls) -> HybridConfig:
        """The embedded model trained on associative recall (hybrid_jax/recall.py, docs/recall.md): ~1M
        parameters; KDA, indexer-sparse MLA, KDA, indexer-sparse MLA (Top-16, well below a prompt's length: the
        softmax-attention layers are all sparse, so retrieval has to go through an indexer); dense SwiGLU and MoE
        (4 experts, 2 routed + 1 shared) alternating; Block AttnRes over blocks of 2 layers. Byte vocabulary.
        Widths are multiples of the hierarchical quantization's tiles (kv_lora_rank 128, indexer head 32)."""
        return cls(
            vocab_size=260,
            hidden_size=128,
            num_layers=4,
            layer_types=("linear", "sparse", "linear", "sparse"),
            mlp_types=("dense", "moe", "dense", "moe"),
            kda_num_heads=4,
            kda_head_dim=32,
            kda_conv_size=4,
            kda_decay_rank=32,
            kda_output_gate_rank=32,
            kda_chunk_size=16,
            num_heads=4,
            q_lora_rank=None,
            kv_lora_rank=128,
            qk_nope_head_dim=32,
            qk_rope_head_dim=16,
            v_head_dim=32,
            index_num_heads=4,
            index_head_dim=32,
            index_rope_dim=16,
            index_topk=16,
            num_experts=4,
            num_experts_per_tok=2,
            num_shared_experts=1,
            routed_scaling_factor=1.0,
            moe_intermediate_size=64,
            intermediate_size=256,
            attn_res_block_size=2,
            max_position_embeddings=512,
            page_size=16,
            bos_token_id=256,
            eos_token_id=257,
            pad_token_id=258,
        )

    @classmethod
    def hybrid_small(cls) -> HybridConfig:
        """About 1.6B parameters (~0.6B active): 3 KDA : 1 sparse MLA, MoE, Block AttnRes; for GPU benchmarks."""
        n = 16
        return cls(
            vocab_size=65536,
            hidden_size=1536,
            num_layers=n,
            layer_types=tuple("sparse" if i % 4 == 3 else "linear" for i in range(n)),
            mlp_types=("dense",) + ("moe",) * (n - 1),
            kda_num_heads=12,
            kda_head_dim=128,
            kda_conv_size=4,
            kda_decay_rank=128,
            kda_output_gate_rank=128,
            num_heads=16,
            q_lora_rank=768,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            mla_use_rope=True,
            rope_theta=10000.0,
            index_num_heads=32,
            index_head_dim=128,
            index_rope_dim=64,
            index_topk=2048,
            num_experts=32,
            num_experts_per_tok=4,
            num_shared_experts=1,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.5,
            moe_intermediate_size=512,
            intermediate_size=4096,
            attn_res_block_size=4,
            rms_norm_eps=1e-5,
            max_position_embeddings=131072 + 4096,
            page_size=64,
        )

    @classmethod
    def kimi_linear_48b(cls) -> HybridConfig:
        """moonshotai/Kimi-Linear-48B-A3B: MLA at 3, 7, ..., 23, 26; KDA elsewhere."""
        full = {3, 7, 11, 15, 19, 23, 26}
        return cls(
            vocab_size=163840,
            hidden_size=2304,
            num_layers=27,
            layer_types=tuple("full" if i in full else "linear" for i in range(27)),
            mlp_types=("dense",) + ("moe",) * 26,
            kda_num_heads=32,
            kda_head_dim=128,
            kda_conv_size=4,
            kda_decay_rank=128,
            kda_output_gate_rank=128,
            num_heads=32,
            q_lora_rank=None,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            mla_use_rope=False,
            num_experts=256,
            num_experts_per_tok=8,
            num_shared_experts=1,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.446,
            norm_topk_prob=True,
            moe_intermediate_size=1024,
            intermediate_size=9216,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            max_position_embeddings=1048576,
            page_size=64,
            bos_token_id=163584,
            eos_token_id=163586,
            pad_token_id=163839,
        )

    @classmethod
    def deepseek_v32(cls) -> HybridConfig:
        """deepseek-ai/DeepSeek-V3.2, without the MTP layer: 61 sparse MLA layers."""
        return cls(
            vocab_size=129280,
            hidden_size=7168,
            num_layers=61,
            layer_types=("sparse",) * 61,
            mlp_types=("dense",) * 3 + ("moe",) * 58,
            num_heads=128,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            mla_use_rope=True,
            rope_theta=10000.0,
            rope_scaling=YarnScaling(
                factor=40.0,
                original_max_position_embeddings=4096,
                beta_fast=32.0,
                beta_slow=1.0,
                mscale=1.0,
                mscale_all_dim=1.0,
            ),
            index_num_heads=64,
            index_head_dim=128,
            index_rope_dim=64,
            index_topk=2048,
            num_experts=256,
            num_experts_per_tok=8,
            num_shared_experts=1,
            n_group=8,
            topk_group=4,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            moe_intermediate_size=2048,
            intermediate_size=18432,
            rms_norm_eps=1e-6,
            max_position_embeddings=163840,
            page_size=64,
            bos_token_id=0,
            eos_token_id=1,
        )

    @classmethod
    def glm5_next_flash(cls) -> HybridConfig:
        """zai-org/GLM-5.3-Flash (`glm5_next`, text part, transformers 5.23 defaults): 45 layers, KDA 3 : 1 NoPE
        DSA MLA with a KPool indexer (pools of 16), 4 hyper-connection streams, clamped SwiGLU, 288 experts."""
        n = 45
        return cls(
            vocab_size=154880,
            hidden_size=4096,
            num_layers=n,
            layer_types=tuple("sparse" if i % 4 == 3 else "linear" for i in range(n)),
            mlp_types=("dense",) * 3 + ("moe",) * (n - 3),
            kda_num_heads=64,
            kda_head_dim=128,
            kda_conv_size=4,
            kda_decay_rank=128,
            kda_output_gate_rank=128,
            kda_gate_lower_bound=-5.0,
            num_heads=64,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=256,
            qk_rope_head_dim=0,
            v_head_dim=256,
            mla_use_rope=False,
            mla_norm_eps=1e-5,
            index_num_heads=32,
            index_head_dim=128,
            index_topk=2048,
            index_kpool=16,
            index_kpool_always_select_tail=True,
            indexer_types=("full",) * n,
            num_experts=288,
            num_experts_per_tok=8,
            num_shared_experts=1,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            moe_intermediate_size=2048,
            intermediate_size=12288,
            swiglu_limit=10.0,
            hc_mult=4,
            hc_sinkhorn_iters=20,
            hc_eps=1e-6,
            rms_norm_eps=1e-5,
            max_position_embeddings=1048576,
            page_size=64,
            pad_token_id=154820,
        )

    @classmethod
    def qwen3_next_80b(cls) -> HybridConfig:
        """Qwen/Qwen3-Next-80B-A3B (`qwen3_next`): 48 layers, Gated DeltaNet 3 : 1 gated GQA (16 query / 2 kv
        heads of 256, RoPE on 64 dims, theta 1e7), 512 experts (10 routed + a gated shared one)."""
        n = 48
        return cls(
            vocab_size=151936,
            hidden_size=2048,
            num_layers=n,
            layer_types=tuple("attention" if i % 4 == 3 else "linear" for i in range(n)),
            mlp_types=("moe",) * n,
            kda_num_heads=32,
            kda_num_k_heads=16,
            kda_head_dim=128,
            kda_v_head_dim=128,
            kda_conv_size=4,
            kda_decay_rank=None,
            kda_output_gate_rank=None,
            kda_scalar_decay=True,
            kda_norm_gate="silu",
            num_heads=16,
            attn_num_kv_heads=2,
            attn_head_dim=256,
            attn_rope_dim=64,
            rope_theta=10_000_000.0,
            num_experts=512,
            num_experts_per_tok=10,
            num_shared_experts=1,
            shared_expert_intermediate_size=512,
            shared_expert_gate=True,
            router_bias=False,
            scoring_func="softmax",
            norm_topk_prob=True,
            moe_intermediate_size=512,
            intermediate_size=5120,
            rms_norm_eps=1e-6,
            norm_zero_centered=True,
            tie_word_embeddings=False,
            max_position_embeddings=262144,
            page_size=64,
            bos_token_id=151643,
            eos_token_id=151645,
        )

    @classmethod
    def qwen3_5_moe_35b(cls) -> HybridConfig:
        """The text model of Qwen3.5-MoE at transformers 5.23's `Qwen3_5MoeTextConfig` defaults (the
        Qwen/Qwen3.5-35B-A3B shapes): Qwen3-Next's layers, 40 of them, 256 experts (8 routed + a gated shared
        one), a 248,320-token vocabulary."""
        return cls.qwen3_next_80b().replace(
            vocab_size=248320,
            num_layers=40,
            layer_types=tuple("attention" if i % 4 == 3 else "linear" for i in range(40)),
            mlp_types=("moe",) * 40,
            num_experts=256,
            num_experts_per_tok=8,
            intermediate_size=0,
            rope_theta=10000.0,
            max_position_embeddings=32768,
            bos_token_id=None,
            eos_token_id=None,
        )


PRESETS = {
    "tiny": HybridConfig.tiny,
    "recall": HybridConfig.recall,
    "hybrid_small": HybridConfig.hybrid_small,
    "kimi_linear_48b": HybridConfig.kimi_linear_48b,
    "deepseek_v32": HybridConfig.deepseek_v32,
    "glm5_next_flash": HybridConfig.glm5_next_flash,
    "qwen3_next_80b": HybridConfig.qwen3_next_80b,
    "qwen3_5_moe_35b": HybridConfig.qwen3_5_moe_35b,
}


def yarn_mscale(scale: float, mscale: float) -> float:
    """DeepSeek's yarn_get_mscale: 0.1 * mscale * ln(scale) + 1 for scale > 1."""
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0
