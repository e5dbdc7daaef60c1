"""Tuned values of the flash-attention kernel (read by `api.py` and `registry.py`); measurements in
docs/performance.md (section "Dense attention")."""

# Shared memory one Triton program may use on sm_90 (H100 / H200), and the widest padded head dim whose tiles
# fit in it with 2 pipeline stages.
SHARED_MEMORY = 232448
MAX_HEAD_DIM = 256

# Starting tiles by operand size (block_q, block_k, num_warps, num_stages), cut by `api.default_tiles` to the
# rows there are and to SHARED_MEMORY. 2-byte: the best at the Kimi MLA prefill shapes.
TILES_2BYTE = dict(block_q=128, block_k=64, num_warps=8, num_stages=3)
TILES_4BYTE = dict(block_q=64, block_k=32, num_warps=4, num_stages=2)
