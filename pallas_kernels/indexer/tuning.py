"""Tuned values of the indexer's kernels and of its dispatch rules (read by `api.py`, `registry.py` and the kernels).

Each value was chosen from timings on a Hopper GPU; the measurements behind them are in docs/performance.md
(section "Indexer")."""

# Scores: from this many queries per call (prefill) the tiled kernel (a key tile read once per query tile) of
# TILED_BLOCK_Q queries; below it (decode) one program per query walks its keys.
TILED_MIN_QUERIES = 64
TILED_BLOCK_Q = 64

# One-query score kernel: keys per program and pipeline stages. KEYS_PER_PROGRAM, or FEW_KEYS_PER_PROGRAM with
# FEW_STAGES when the call would otherwise run fewer than FEW_SCORE_PROGRAMS programs (one long row at B=1:
# more, shorter programs hide more latency).
KEYS_PER_PROGRAM, STAGES = 1024, 2
FEW_KEYS_PER_PROGRAM, FEW_STAGES = 512, 3
FEW_SCORE_PROGRAMS = 264

# Scores per step of the selection kernel.
SELECT_CHUNK = 4096

# Which Top-K selection `select=None` runs (`registry.selection`):
# - from SELECT_KERNEL_MIN_ROWS rows (prefill) the selection kernel, one program per row: thousands of rows
#   fill the GPU, where one latency-bound program per long row would not;
# - rows of at most NEAR_FULL_KEYS_PER_K x topk keys also the selection kernel: lax.top_k with K this close to
#   the row length sorts the whole row;
# - fewer rows of at least SPLIT_MIN_KEYS_PER_K x topk keys (decode at long context) the split selection,
#   each row's passes over many programs;
# - else lax.top_k.
SELECT_KERNEL_MIN_ROWS = 512
NEAR_FULL_KEYS_PER_K = 2
SPLIT_MIN_KEYS_PER_K = 8
# Up to this many rows the split selection ranks its candidates best first in its own kernels (work grows
# as rows x candidates^2) instead of selecting per row and sorting the K chosen after.
RANK_MAX_ROWS = 4

# The fused decode prolog takes calls of up to this many rows (batch x new tokens); prefill-sized
# projections are matmuls that XLA tiles better.
PROLOG_MAX_ROWS = 64

# Selection kernels (`select_kernel.py`, `select_split.py`); measurements in docs/performance.md#indexer.

# Radix selection programs (the row kernel's defaults, and the split selection's last step and ranking search):
# bits per radix digit (each pass compares every score with 2^bits - 1 candidates: the kernel is bound by
# those comparisons), warps and pipeline stages of a program that selects one row.
SELECT_DIGIT_BITS = 2
SELECT_WARPS = 8
SELECT_STAGES = 2

# Prefilter of long rows: between k and PREFILTER_WIDTH_PER_K x k candidates at or above a bound; at most
# PREFILTER_PASSES bound searches before a row (heavy-tailed, tie-heavy) is left to the full selection;
# `prefilter=None` runs it on rows of at least PREFILTER_MIN_ROWS_PER_WIDTH x its candidate width.
PREFILTER_WIDTH_PER_K = 2
PREFILTER_PASSES = 8
PREFILTER_MIN_ROWS_PER_WIDTH = 4

# Split selection bounds: x k scores at or above where a normal distribution would put them (below 1: a right
# tail heavier than normal puts more there than the normal predicts), and values at these fractions of the
# way from the max down to the min (heavy tails). len(QUANTILE_TARGETS) + len(SPREAD_FRACTIONS) + 2 (the mean
# and the min) must stay a power of two (`select_split.NUM_BOUNDS`, a block shape).
QUANTILE_TARGETS = (0.5, 0.7, 0.85, 0.95, 1.03, 1.1, 1.2, 1.4, 1.7, 2.5)
SPREAD_FRACTIONS = (1 / 256, 1 / 32, 1 / 8, 1 / 2)
# Split selection passes: programs aimed for across all rows (sm_90: 132 SMs), the smallest segment, scores
# per step of a pass, warps per program.
TARGET_PROGRAMS = 128
MIN_SEGMENT = 256
PASS_CHUNK = 1024
PASS_WARPS = 4
# Best-first ranking: rows of up to RANK_MAX_PER_K x k candidates ranked whole (O(n^2) compares), RANK_BLOCK
# candidates per program compared RANK_STEP at a time; rows with more: candidates per step of the in-kernel
# K-th key search and of the scan for a program's chosen ones; the ranking's warps and pipeline stages.
RANK_MAX_PER_K = 2
RANK_BLOCK = 16
RANK_STEP = 1024
RANK_SEARCH_CHUNK = 4096
RANK_GATHER_CHUNK = 1024
RANK_WARPS = 8
RANK_STAGES = 1
