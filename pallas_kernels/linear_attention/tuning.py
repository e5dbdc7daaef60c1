"""Tuned values of the KDA chunked-prefill kernels (read by `chunked.py`) and of the verify-layer kernel.

Chosen from timings on a Hopper GPU of a 32K-token x 32-head bfloat16 prefill, each kernel alone and the whole
prefill; the measurements are in docs/performance.md (section "KDA prefill")."""

# Warps of the intra-chunk phase's (A kernel, solve kernel); the chunk cumsum takes the first. The A kernel
# keeps several [64, K] float32 tiles live at once and spills registers with fewer warps; the solve kernel's
# chain of dependent [64, 64] products runs best at fewer.
INTRA_WARPS = (8, 4)
# The A kernel's block forms `kda(a_blocks=None)` takes (`chunked._a_pairs`: the row pairs inside blocks of 64, else
# 16, rows from one reference row per block; chunks whose gates are too strong for both take the binary split). On:
# the whole prefill 1.23-1.27x faster at 4K-128K tokens and 32-96 heads where 64-row blocks apply, 1.14x at gates
# that leave 16-row ones (docs/performance.md, "KDA prefill"; a prefill whose chunks all take the split: untimed).
A_BLOCKS = (64, 16)
# Software-pipelining stages of the state pass with bfloat16 intermediates: its loads of the next chunk's
# tiles overlap this chunk's products.
STATE_STAGES = 3
# float32 intermediates ("tf32" / "ieee" products) hold twice the bytes per tile: at 2 or 3 stages the state
# pass asks for more shared memory than an sm_90 block may have (232,448 bytes) at Kimi-Linear and
# hybrid_small widths, so it runs unpipelined.
WIDE_STATE_STAGES = 1

# Value columns per program of the verify-layer kernel (`layer_decode.verify_layer_pallas`): a head's [K, V]
# float32 state in one program ran on 32 programs at Kimi's batch 1 (docs/performance.md, "Speculative decoding").
VERIFY_BLOCK_V = 32

# Whether "auto" runs the state pass in Mosaic GPU (`state_mosaic.py`) on a Hopper GPU where it takes the call
# (bf16 inputs and products, K <= 128; packed sequences too, one program per sequence). On: the whole
# 32K prefill ran faster with it than with the Triton state pass at 64 and 96 heads, and level at 32
# (docs/performance.md, "KDA prefill").
MOSAIC_STATE_PASS = True
