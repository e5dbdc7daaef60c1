"""Checkpoint I/O: Hugging Face safetensors (kimi_linear, deepseek_v32, hybrid) and orbax.

Parameter names in `hybrid_jax` follow the Hugging Face checkpoints (`self_attn.q_proj`, `kv_b_proj`,
`self_attn.indexer.wq_b`, `mlp.experts`, ...), so the mapping written here is one to one: a torch Linear
`weight [out, in]` is our `kernel [in, out]`, and per-expert tensors stack into `[E, ...]`.
"""
