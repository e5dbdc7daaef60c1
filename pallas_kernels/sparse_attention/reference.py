"""Index-based sparse MLA in the absorbed form (ARCH_SPEC §3.3, §4.4), float32 jnp: the ground truth.

For query t and head n over its selected positions s in I(t) (shared by all heads):
    logit[n, s] = scale * (q_latent[n] . c_s + q_rope[n] . k_rope_s)
    out[n] = sum_s softmax(logit[n])_s c_s          (latent space; the caller applies W_UV)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.paged import gather_rows

HIGHEST = jax.lax.Precision.HIGHEST


def sparse_mla_reference(q_latent, q_rope, kv_pages, page_table, indices, *, scale):
    lat = q_latent.shape[-1]
    rows = gather_rows(kv_pages, page_table, indices).astype(jnp.float32)  # [B,T,K,L+R]
    c, kr = rows[..., :lat], rows[..., lat:]
    logits = (
        jnp.einsum("btnl,btkl->btnk", q_latent.astype(jnp.float32), c, precision=HIGHEST)
        + jnp.einsum("btnr,btkr->btnk", q_rope.astype(jnp.float32), kr, precision=HIGHEST)
    ) * scale
    logits = jnp.where((indices >= 0)[:, :, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(logits - m_safe)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("btnk,btkl->btnl", p, c, precision=HIGHEST)
    return out.astype(q_latent.dtype), (jnp.log(denom) + m_safe)[..., 0]
