"""Public entry point of dense causal attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._pallas import auto_impl, pow2
from pallas_kernels.attention.kernel import flash_attention_pallas
from pallas_kernels.attention.reference import attention_reference

IMPLS = ("auto", "reference", "pallas")
MAX_HEAD_DIM = 256  # padded head dims the kernel's tiles fit in shared memory with (H200, 2 stages)


def default_tiles(dtype) -> dict:
    """The kernel's tiles and Triton parameters when `attention` is not given them (block_q, block_k,
    num_warps, num_stages)."""
    if jnp.dtype(dtype).itemsize <= 2:  # measured best at the Kimi MLA shapes (benchmarks/attention.py)
        return dict(block_q=128, block_k=64, num_warps=8, num_stages=3)
    return dict(block_q=64, block_k=32, num_warps=4, num_stages=2)


def attention(
    q,
    k,
    v,
    *,
    q_positions,
    kv_lengths,
    scale,
    impl: str = "auto",
    block_q: int | None = None,
    block_k: int | None = None,
    precision: str = "tf32",
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool | None = None,
):
    """Causal (G)QA: q [B,T,N,H], k [B,S,K,H], v [B,S,K,Hv] -> (out [B,T,N,Hv] in q.dtype, lse [B,T,N]).

    Key s is visible to query t iff s <= q_positions[b, t] and s < kv_lengths[b]; a query that sees no key
    gets 0 and LSE -inf.
    impl: "reference" (f32 jnp, materialised logits per query block), "pallas" (`kernel.flash_attention_pallas`:
    online softmax, key blocks up to each query block's last visible position, the blocks every row sees
    whole without a mask; products in the input dtype with float32 accumulation, `precision` "tf32" or
    "ieee" for float32 inputs), or "auto" (Pallas on GPU when the q/k head dim rounded up to a multiple of
    16 and the v head dim rounded up to a power of two are <= 256, else the reference: the absorbed MLA
    decode, 512 + 64 wide, stays on the reference).
    Tiles (`block_q` rows x `block_k` keys, Triton's `num_warps` / `num_stages`) default to
    `default_tiles(q.dtype)`; a default `block_q` shrinks to the rows there are (a grouped decode's G rows).
    """
    if impl not in IMPLS:
        raise ValueError(f"attention: unknown impl={impl!r}; expected one of {IMPLS}")
    b, t, n, h = q.shape
    s, nk, hv = k.shape[1], k.shape[2], v.shape[-1]
    if n % nk or k.shape[-1] != h or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"attention: inconsistent shapes q={q.shape} k={k.shape} v={v.shape}")
    hp, hvp = -(-h // 16) * 16, pow2(hv)  # q/k read as power-of-two pieces (kernel.head_pieces)
    supported = max(hp, hvp) <= MAX_HEAD_DIM
    if impl == "auto":
        impl = "pallas" if auto_impl("attention", supported) else "reference"
    if impl == "reference":
        return attention_reference(q, k, v, q_positions=q_positions, kv_lengths=kv_lengths, scale=scale)
    if not supported:
        raise ValueError(f"attention(impl='pallas'): head dims {h}, {hv} pad past {MAX_HEAD_DIM}")
    g = n // nk
    rows = t * g
    tiles = default_tiles(q.dtype)
    if block_q is None:
        block_q = min(tiles["block_q"], max(16, pow2(rows)))
    bk = block_k or tiles["block_k"]
    for name, val in (("block_q", block_q), ("block_k", bk)):
        if val < 16 or val & (val - 1):
            raise ValueError(f"attention: {name}={val} must be a power of two >= 16")
    num_warps = num_warps or tiles["num_warps"]
    num_stages = num_stages or tiles["num_stages"]
    rp = -(-rows // block_q) * block_q
    sp = -(-s // bk) * bk
    # rows of one KV head's group: query t, head g -> row t * G + g
    qr = q.reshape(b, t, nk, g, h).transpose(0, 2, 1, 3, 4).reshape(b * nk, rows, h)
    qr = jnp.pad(qr, [(0, 0), (0, rp - rows), (0, hp - h)])
    pos = jnp.repeat(q_positions.astype(jnp.int32), g, axis=1)  # [B, T*G]
    pos = jnp.pad(jnp.broadcast_to(pos[:, None], (b, nk, rows)).reshape(b * nk, rows), [(0, 0), (0, rp - rows)],
                  constant_values=-1)  # fmt: skip
    kr = jnp.pad(k.transpose(0, 2, 1, 3).reshape(b * nk, s, h), [(0, 0), (0, sp - s), (0, hp - h)]).astype(q.dtype)
    vr = jnp.pad(v.transpose(0, 2, 1, 3).reshape(b * nk, s, hv), [(0, 0), (0, sp - s), (0, hvp - hv)]).astype(q.dtype)
    kvl = jnp.repeat(kv_lengths.astype(jnp.int32), nk)
    out, lse = flash_attention_pallas(
        qr, kr, vr, pos, kvl, scale=float(scale), block_q=block_q, block_k=bk, precision=precision,
        interpret=jax.default_backend() == "cpu" if interpret is None else interpret, num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    out = out[:, :rows, :hv].reshape(b, nk, t, g, hv).transpose(0, 2, 1, 3, 4).reshape(b, t, n, hv)
    lse = lse[:, :rows].reshape(b, nk, t, g).transpose(0, 2, 1, 3).reshape(b, t, n)
    return out, lse
