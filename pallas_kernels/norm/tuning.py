"""Tuned values of the RMSNorm kernel (read by `api.py` and `registry.py`)."""

# The kernel stands for XLA's reduce + scale at decode sizes only (rows per call); prefill keeps XLA's.
MAX_ROWS = 16
