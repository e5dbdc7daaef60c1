"""Tuned values of the dense MLA decode kernel (read by `api.py`). Measurements: docs/performance.md
("Long context")."""

# Programs the grid aims at: the splits of each sequence's context are sized at run time, so a split count
# that gives this many programs (head blocks x splits x sequences) keeps every SM busy at any context length;
# programs past a short context's end exit at once.
TARGET_PROGRAMS = 264

# At most this many splits of one sequence (each writes a [M, L] partial output that the LSE merge reads back).
MAX_SPLITS = 256

# (block_k, num_warps, num_stages) by head block for bfloat16 products, and for float32 ones ("tf32" / "ieee":
# twice the bytes per loaded tile). The head block: the largest of 64 / 32 / 16 that the query rows fill.
BF16_TILES = {64: (64, 8, 2), 32: (64, 4, 3), 16: (64, 4, 3)}
F32_TILES = {64: (32, 8, 2), 32: (32, 4, 2), 16: (32, 4, 2)}
