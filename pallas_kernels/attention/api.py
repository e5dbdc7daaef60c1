"""Public entry point of dense causal attention."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import registry
from pallas_kernels._pallas import pow2
from pallas_kernels.attention.kernel import flash_attention_pallas
from pallas_kernels.attention.reference import attention_reference
from pallas_kernels.attention.tuning import MAX_HEAD_DIM, SHARED_MEMORY, TILES_2BYTE, TILES_4BYTE


def shared_bytes(block_q: int, block_k: int, num_stages: int, h: int, hv: int, itemsize: int) -> int:
    """Shared memory of one program: the q tile plus `num_stages` buffered k and v tiles (h the q/k width as
    read — a multiple of 16 —, hv the padded v width), as Triton sizes it."""
    return (block_q * h + num_stages * block_k * (h + hv)) * itemsize


def default_tiles(dtype, h: int = 128, hv: int = 128, *, rows: int | None = None, **given) -> dict:
    """The kernel's tiles and Triton parameters (block_q, block_k, num_warps, num_stages) for a q/k width h
    and v width hv (both as the kernel reads them): the values in `given` (those not None) as they are, the
    others from `tuning` with block_q no larger than the `rows` there are (a grouped decode's G rows), then
    stages, rows and keys cut until the tiles fit in shared memory (wide heads)."""
    itemsize = jnp.dtype(dtype).itemsize
    tiles = dict(TILES_2BYTE if itemsize <= 2 else TILES_4BYTE)
    if rows is not None:
        tiles["block_q"] = min(tiles["block_q"], max(16, pow2(rows)))
    fixed = {k for k, v in given.items() if v is not None}
    tiles.update({k: given[k] for k in fixed})

    def fits():
        return shared_bytes(tiles["block_q"], tiles["block_k"], tiles["num_stages"], h, hv, itemsize) <= SHARED_MEMORY

    for key, floor in (("num_stages", 2), ("block_q", 64), ("block_k", 32), ("block_q", 16), ("block_k", 16)):
        while key not in fixed and not fits() and tiles[key] > floor:
            tiles[key] = tiles[key] - 1 if key == "num_stages" else tiles[key] // 2
    return tiles


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
    "ieee" for float32 inputs), or "auto" (`registry.resolve("attention", ...)`: the kernel takes a q/k head
    dim rounded up to a multiple of 16 and a v head dim rounded up to a power of two of at most
    `tuning.MAX_HEAD_DIM`).
    Tiles (`block_q` rows x `block_k` keys, Triton's `num_warps` / `num_stages`) not given come from
    `default_tiles`.
    """
    registry.check_impl("attention", impl)
    b, t, n, h = q.shape
    s, nk, hv = k.shape[1], k.shape[2], v.shape[-1]
    if n % nk or k.shape[-1] != h or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"attention: inconsistent shapes q={q.shape} k={k.shape} v={v.shape}")
    hp, hvp = -(-h // 16) * 16, pow2(hv)  # q/k read as power-of-two pieces (kernel.head_pieces)
    impl = registry.resolve("attention", impl, head_dim=h, v_head_dim=hv).impl
    if impl == "reference":
        return attention_reference(q, k, v, q_positions=q_positions, kv_lengths=kv_lengths, scale=scale)
    if max(hp, hvp) > MAX_HEAD_DIM:
        raise ValueError(f"attention(impl='pallas'): head dims {h}, {hv} pad past {MAX_HEAD_DIM}")
    g = n // nk
    rows = t * g
    tiles = default_tiles(
        q.dtype, hp, hvp, rows=rows, block_q=block_q, block_k=block_k, num_warps=num_warps, num_stages=num_stages
    )
    block_q, bk, num_warps, num_stages = (tiles[k] for k in ("block_q", "block_k", "num_warps", "num_stages"))
    for name, val in (("block_q", block_q), ("block_k", bk)):
        if val < 16 or val & (val - 1):
            raise ValueError(f"attention: {name}={val} must be a power of two >= 16")
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
        interpret=registry.interpret_default(interpret), num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    out = out[:, :rows, :hv].reshape(b, nk, t, g, hv).transpose(0, 2, 1, 3, 4).reshape(b, t, n, hv)
    lse = lse[:, :rows].reshape(b, nk, t, g).transpose(0, 2, 1, 3).reshape(b, t, n)
    return out, lse
