"""Tuned values of the projection GEMV kernel and its dispatch rule (read by `api.py` and `registry.py`);
measurements in docs/performance.md (section "Projections")."""

# The kernels take up to MAX_ROWS rows (one tensor-core tile, `kernel.ROWS`). impl="auto" runs them on a GPU for up to
# AUTO_MAX_ROWS rows of a weight that needs a contraction split: one row is where XLA's multiply + reduce
# form loses; from a few rows XLA's GEMM matches the padded-tile kernel, and weights wide enough to need no
# split (an LM head) stream as fast through XLA.
MAX_ROWS = 16
AUTO_MAX_ROWS = 1
# Programs `auto_split_k` aims for: two per SM of a 132-SM GPU, so every SM streams weights while its other
# program waits on memory; and the most contraction splits it makes.
TARGET_PROGRAMS = 264
MAX_SPLIT_K = 32
