"""Tuned values of the MoE kernels and of their dispatch rule (read by `api.py` and `registry.py`).

Chosen from timings of decode- and prefill-sized calls at Kimi-Linear and hybrid_small widths on a Hopper
GPU; the measurements are in docs/performance.md (section "MoE")."""

# Which kernel `moe_experts(impl="auto")` runs on a GPU (`registry._moe_pick`):
# - up to GEMV_MAX_PAIRS token-expert pairs (one decoded token) the per-pair GEMV kernels: each pair reads its
#   expert's weights in place; from a few tokens on, pairs that share an expert read it again;
# - above DENSE_MAX_EXPERTS experts, or from GROUPED_MIN_PAIRS pairs, the grouped-matmul kernel
#   (`lax.ragged_dot` reads every expert's weights at every call);
# - with at most DENSE_MAX_EXPERTS experts, up to EXPERT_GEMV_MAX_TOKENS tokens (a 3-token speculative verify
#   block) the expert-grouped GEMV kernels (each expert the call touches read once for all its rows), up to
#   FEW_TOKENS_GROUPED_MAX the grouped kernel (16-row blocks): both read only the touched experts;
# - else `lax.ragged_dot` (batched decode of models with few experts).
GEMV_MAX_PAIRS = 10  # one decoded token of Kimi, DeepSeek, GLM (k = 8) and Qwen3-Next (k = 10)
EXPERT_GEMV_MAX_TOKENS = 3  # at most `expert_gemv.GROUP_ROWS`
FEW_TOKENS_GROUPED_MAX = 5  # a k = 4 verify block; at 16 tokens the runs disagree (docs/performance.md)
DENSE_MAX_EXPERTS = 32
GROUPED_MIN_PAIRS = 256

# Grouped kernel row blocks: DECODE_BLOCK_M rows while a call is small (fewer than
# max(SMALL_CALL_PAIRS, DECODE_BLOCK_M x experts) pairs: less padding per expert), else PREFILL_TILES.
DECODE_BLOCK_M = 16
SMALL_CALL_PAIRS = 512
DECODE_TILES = dict(num_warps=4, num_stages=2)
PREFILL_TILES = dict(block_m=128, num_warps=8, num_stages=3)
# 4-byte operands hold twice the bytes per tile: at 3 stages the prefill tiles exceed sm_90's 227 KiB of
# shared memory, so float32 models run at most this many.
WIDE_OPERAND_MAX_STAGES = 2
# Output / contraction tiles (block_n, block_k) of each kernel.
GROUPED_TILES = (128, 64)
GEMV_TILES = (64, 128)
# The per-pair down kernel (form "gemv"): wider output tiles, shallower steps; its splits by SPLIT_TARGET as
# gate/up's (timed against GEMV_TILES at every shipped model's widths: docs/performance.md, MoE).
GEMV_DOWN_TILES = (128, 64)

# The router kernels (GEMV partial logits + one selection program per token) take up to this many tokens
# (the GEMV's row limit): decode. Prefill keeps XLA's batched product and top-k.
ROUTER_MAX_ROWS = 16

# Per-pair GEMV kernels (`gemv.auto_split_k`): contraction splits are doubled until a call launches
# SPLIT_TARGET programs (about 8 resident CTAs per SM of a 132-SM sm_90 GPU, enough weight bytes in flight),
# at most MAX_SPLIT_K.
SPLIT_TARGET = 1024
MAX_SPLIT_K = 16

# The reference (`reference.moe_experts_reference`) runs its tokens in blocks when XLA's `ragged_dot` lowering
# could build an operand [rows, E x max(D, F)] of more than this many elements (it may expand over all experts):
# a memory budget, set below the size that ran out of memory.
MAX_EXPANDED_ELEMENTS = 1 << 34
