"""Tuned values of the sparse-MLA kernels and their dispatch rule (read by `api.py` and `registry.py`).

Chosen from sweeps on a Hopper GPU at decode (B = 16-128, top-2048) and prefill (T = 4096-16384) shapes at 16
and 128 heads; the measurements are in docs/performance.md (section "Sparse MLA")."""

# The Mosaic GPU kernel (sm_90) runs from this many heads: it computes 64 heads a CTA, and below 64 the
# padding costs more than the kernel saves against the Triton kernel on a BF16 pool (or an FP8 pool dequantized
# whole, the prefill case of `POOL_DEQUANT_MIN_RATIO`).
MOSAIC_MIN_HEADS = 64
# Where an FP8 latent pool is read row by row (decode) the padded Mosaic GPU kernel, whose producer warpgroup
# converts the rows, runs from MOSAIC_MIN_HEADS_FP8_ROWS heads at any number of query rows: the Triton FP8-row
# kernel converts every gathered E4M3 value in the warps that issue the products, and at 16 heads its kernel
# time is above the padded Mosaic kernel's from one query row up (docs/performance.md, "Which sparse-MLA
# kernel"). Timed at 16 heads only (17-63 pad less).
MOSAIC_MIN_HEADS_FP8_ROWS = 16

# Split of the selected rows into parts merged by LSE (flash-decoding) when the grid (query rows x head
# blocks) would leave SMs idle: parts are added while the grid stays at most TARGET_PROGRAMS programs
# (SMALL_BLOCK_TARGET_PROGRAMS for 16-head blocks with WIDE_DECODE_ROWS..MANY_ROWS query rows) and each part
# keeps at least MIN_ROWS_PER_SPLIT rows.
TARGET_PROGRAMS = 128
SMALL_BLOCK_TARGET_PROGRAMS = 256
MIN_ROWS_PER_SPLIT = 128

# Query-row classes of the tile table: from MANY_ROWS a prefill (programs to spare), from WIDE_DECODE_ROWS a
# decode at a larger batch, else a small decode.
MANY_ROWS = 1024
WIDE_DECODE_ROWS = 64

# An FP8 latent pool is dequantized whole and read by the BF16-row kernel once query rows x selected rows reach
# this many times the pool's rows (a prefill: every program would convert the rows it gathers); at decode the
# FP8-row kernel reads half the bytes. A cost estimate, not a measured crossover.
POOL_DEQUANT_MIN_RATIO = 8

# (block_k, num_warps, num_stages) of the Triton kernel by head block, for bf16 products on a BF16 pool.
# 16-head blocks depend on the query rows: "prefill" (>= MANY_ROWS), "wide" (>= WIDE_DECODE_ROWS), "decode".
BF16_TILES = {64: (64, 8, 2), 32: (64, 4, 3)}
BF16_TILES_16 = {"prefill": (32, 2, 3), "wide": (64, 4, 2), "decode": (32, 4, 2)}
# The same on an FP8 latent pool (bf16 products), by head block; the head block from the head count: the
# largest of 64 / 32 / 16 that the heads fill.
FP8_TILES = {64: (64, 8, 2), 32: (64, 4, 2), 16: (32, 4, 2)}
# float32 queries ("tf32" / "ieee" products) hold twice the bytes per gathered tile: 32 rows a step, 2 stages,
# 32-head blocks from 32 heads (4 warps; 8 for larger blocks), 16-head blocks below.
F32_BLOCK_K, F32_STAGES = 32, 2
