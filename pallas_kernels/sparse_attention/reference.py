"""Index-based sparse MLA in the absorbed form (docs/architecture.md §5, §6), float32 jnp: the ground truth.

For query t and head n over its selected positions s in I(t) (shared by all heads, distinct):
    logit[n, s] = scale * (q_latent[n] . c_s + q_rope[n] . k_rope_s)
    out[n] = sum_s softmax(logit[n])_s c_s          (latent space; the caller applies W_UV)
Two equivalent evaluations, picked by size: gather the K selected rows per query (cheap for few queries
over a long context), or score every cached row and mask the unselected ones (the DeepSeek reference's
prefill form; cheap when N*S < K*(L+R)). Queries are processed in memory-bounded blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._blocking import masked_softmax, over_query_blocks, query_block_size
from pallas_kernels.paged import gather_pages, gather_rows

HIGHEST = jax.lax.Precision.HIGHEST


def sparse_mla_reference(q_latent, q_rope, kv_pages, page_table, indices, *, scale, form: str = "auto"):
    """form: "gather", "mask" or "auto" (the cheaper of the two for these shapes)."""
    b, t, n, lat = q_latent.shape
    k = indices.shape[-1]
    width = kv_pages.shape[-1]
    s = page_table.shape[1] * kv_pages.shape[1]

    def finish(logits, visible, values, spec):
        p, lse = masked_softmax(logits, visible)
        return jnp.einsum(spec, p, values, precision=HIGHEST).astype(q_latent.dtype), lse

    if form not in ("auto", "gather", "mask"):
        raise ValueError(f"sparse_mla_reference: unknown form={form!r}")
    if form == "mask" or (form == "auto" and n * s <= k * width):
        ctx = gather_pages(kv_pages, page_table).astype(jnp.float32)  # [B,S,L+R]

        def block(ql, qr, idx):
            tb = ql.shape[1]
            logits = jnp.einsum(
                "btnl,bsl->btns", ql.astype(jnp.float32), ctx[..., :lat], precision=HIGHEST
            ) + jnp.einsum("btnr,bsr->btns", qr.astype(jnp.float32), ctx[..., lat:], precision=HIGHEST)
            sel = jnp.zeros((b, tb, s + 1), bool)
            sel = sel.at[jnp.arange(b)[:, None, None], jnp.arange(tb)[None, :, None], jnp.where(idx >= 0, idx, s)].set(
                True
            )[..., :s]
            return finish(logits * scale, sel[:, :, None, :], ctx[..., :lat], "btns,bsl->btnl")

        per_query = b * n * s
    else:

        def block(ql, qr, idx):
            rows = gather_rows(kv_pages, page_table, idx).astype(jnp.float32)  # [B,T,K,L+R]
            logits = jnp.einsum(
                "btnl,btkl->btnk", ql.astype(jnp.float32), rows[..., :lat], precision=HIGHEST
            ) + jnp.einsum("btnr,btkr->btnk", qr.astype(jnp.float32), rows[..., lat:], precision=HIGHEST)
            return finish(logits * scale, (idx >= 0)[:, :, None, :], rows[..., :lat], "btnk,btkl->btnl")

        per_query = b * k * (width + n)

    return over_query_blocks(block, query_block_size(t, per_query), q_latent, q_rope, indices)
