"""Public entry point of dense attention."""

from __future__ import annotations

from pallas_kernels.attention.reference import attention_reference

IMPLS = ("auto", "reference")


def attention(q, k, v, *, q_positions, kv_lengths, scale, impl: str = "auto"):
    """Causal (G)QA: q [B,T,N,H], k [B,S,K,H], v [B,S,K,Hv] -> (out [B,T,N,Hv], lse [B,T,N]).

    Key s is visible to query t iff s <= q_positions[b, t] and s < kv_lengths[b].
    impl: "reference" (f32 jnp) or "auto" (the best available; today the reference)."""
    if impl not in IMPLS:
        raise ValueError(f"attention: unknown impl={impl!r}; expected one of {IMPLS}")
    return attention_reference(q, k, v, q_positions=q_positions, kv_lengths=kv_lengths, scale=scale)
