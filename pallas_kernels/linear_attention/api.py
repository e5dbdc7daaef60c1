"""Public entry point of Kimi Delta Attention (and Gated DeltaNet)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import registry
from pallas_kernels._pallas import pow2
from pallas_kernels.linear_attention import state_mosaic
from pallas_kernels.linear_attention import tuning as kda_tuning
from pallas_kernels.linear_attention.chunked import CHUNK, check_a_blocks, kda_chunked_pallas, kda_state_summary_pallas
from pallas_kernels.linear_attention.decode import decode_step_pallas
from pallas_kernels.linear_attention.layer_decode import decode_layer_pallas, verify_layer_pallas
from pallas_kernels.linear_attention.reference import (
    apply_summary,
    compose_summaries,
    kda_chunked,
    kda_decode_layer_reference,
    kda_recurrent,
    kda_verify_layer_reference,
)
from pallas_kernels.linear_attention.reference import kda_state_summary as _kda_state_summary
from pallas_kernels.projection.api import SplitK, materialize

__all__ = [
    "apply_summary",
    "compose_summaries",
    "decode_layer_uses_kernel",
    "kda",
    "kda_decode_layer",
    "kda_decode_step",
    "kda_state_summary",
]

FORMS = ("chunked", "recurrent")  # the reference's two algorithms (`form=`)


def kda(
    q,
    k,
    v,
    g,
    beta,
    *,
    initial_state=None,
    scale=None,
    use_qk_l2norm=True,
    impl: str = "auto",
    form: str | None = None,
    chunk_size: int = 64,
    block_v: int = 32,
    precision: str | None = None,
    num_warps: int = 4,
    interpret: bool | None = None,
    cu_seqlens=None,
    solve: str = "neumann",
    state_every: int | None = None,
    a_blocks: tuple[int, ...] | None = None,
):
    """Gated delta rule with per-channel (g [B,T,N,K]) or per-head (g [B,T,N]) log decay.

    q, k [B,T,N,K]; v [B,T,N,V]; beta [B,T,N]; initial_state [B,N,K,V] float32 or None.
    Returns (o [B,T,N,V] in q.dtype, final_state [B,N,K,V] float32). q and k are L2-normalised inside
    (eps 1e-6 under the root) when use_qk_l2norm; q is scaled by `scale` (default K^-1/2).
    impl (see `pallas_kernels.registry`): "reference" (jnp; `form` "chunked": the WY/UT chunked form over
    chunks of `chunk_size`, the default for more than one token, or "recurrent": the token scan, the default
    for one), "pallas" (the kernels of `chunked.kda_chunked_pallas`: the intra-chunk work parallel over chunks
    of 64, then the state pass), "mosaic" (the same, the state pass in Pallas Mosaic GPU:
    `state_mosaic.kda_state_pass_mosaic`; Hopper, or its interpreter with `interpret`; bfloat16 inputs and
    products, K <= 128; what "auto" runs on sm_90 where it applies, while `tuning.MOSAIC_STATE_PASS` is on) or "auto"
    (`registry.resolve("kda_prefill", ...)`).
    Pallas options: `block_v` state columns per program, `precision` of its matrix products ("tf32"; "bf16":
    operands in bfloat16 as fla's kernels do, the (I + A)⁻¹ chain kept in TF32; "ieee"; default: "bf16" for
    bfloat16 inputs, "tf32" otherwise), `num_warps` per program, `interpret` (default: on a CPU), `solve`: how
    the intra-chunk kernel forms (I + A_kk)⁻¹ — "neumann" (tensor-core products, the default) or
    "substitution" (row-by-row forward substitution in float32; opt-in), `a_blocks`: block sizes (from
    (64, 32, 16), largest first) the A kernel tries per chunk — the row pairs inside blocks of the first size
    whose decay the chunk's gates keep within range from one reference row per block (2 products at 64 rows,
    6 at 16, against the 13 of the binary split, which chunks with stronger gates take); None (default):
    `tuning.A_BLOCKS`, () the binary split alone.
    Variable-length batch: `cu_seqlens` [S + 1] (host ints, 0 = first, last = T) packs S sequences along
    time in a batch of one; initial_state is then [S,N,K,V] and the final states come back per sequence.
    The Pallas path lays the sequences end to end, each padded to whole 64-token chunks (phase 1 reads the
    packed inputs in place), one state-pass program per (sequence, head, value block) from its own state,
    writing o in the sequence's own rows ("mosaic": the Mosaic GPU state pass, the same way);
    the jnp forms run them as one batch padded to the longest (pads at each row's end change no state).
    state_every=E (a positive int; not with cu_seqlens): also the states after every E tokens, a third output
    [B, T // E, N, K, V] float32 whose entry j is the state after tokens [0, (j + 1)·E) — what a prefix cache
    keeps at its block boundaries. The Pallas path stores them from its state pass where E is a multiple of 64
    (nothing recomputed); otherwise, and for the jnp forms, the sequence runs as a `lax.scan` over segments of
    E tokens, each a call of this function from the state the one before left.
    """
    registry.check_impl("kda_prefill", impl)
    if form not in (None, *FORMS):
        raise ValueError(f"kda: form={form!r} must be one of {FORMS}")
    if form is not None and impl in ("pallas", "mosaic"):
        raise ValueError(f"kda: form={form!r} names a reference algorithm; impl={impl!r} has one")
    if q.ndim != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3] or beta.shape != q.shape[:3]:
        raise ValueError(f"kda: inconsistent shapes q={q.shape} k={k.shape} v={v.shape} beta={beta.shape}")
    if g.shape not in (q.shape, q.shape[:3]):
        raise ValueError(f"kda: g.shape={g.shape} must be {q.shape} (per channel) or {q.shape[:3]} (per head)")
    if chunk_size <= 0:
        raise ValueError(f"kda: chunk_size={chunk_size} must be positive")
    if solve not in ("neumann", "substitution"):
        raise ValueError(f"kda: solve={solve!r} must be 'neumann' or 'substitution'")
    if precision not in (None, "tf32", "bf16", "ieee"):
        raise ValueError(f"kda: precision={precision!r} must be 'tf32', 'bf16' or 'ieee'")
    a_blocks = kda_tuning.A_BLOCKS if a_blocks is None else a_blocks
    check_a_blocks(a_blocks, "kda")
    if impl == "auto" and form is None:
        why_not = _mosaic_why_not(q, precision)
        impl = registry.resolve("kda_prefill", impl, tokens=q.shape[1], mosaic_why_not=why_not).impl
    elif impl == "auto":  # a reference form asked for
        impl = "reference"
    if state_every is not None:
        return _with_states(
            q, k, v, g, beta, state_every, cu_seqlens,
            dict(initial_state=initial_state, scale=scale, use_qk_l2norm=use_qk_l2norm, impl=impl, form=form,
                 chunk_size=chunk_size, block_v=block_v, precision=precision, num_warps=num_warps,
                 interpret=interpret, solve=solve, a_blocks=a_blocks),
        )  # fmt: skip
    if cu_seqlens is not None:
        if impl == "mosaic":
            why = _mosaic_why_not(q, precision)
            if why is not None:
                raise ValueError(f"kda: impl='mosaic' needs {why}")
        if impl in ("pallas", "mosaic"):
            kw = dict(scale=scale, use_qk_l2norm=use_qk_l2norm, block_v=block_v,
                      precision=_pallas_precision(precision, q), interpret=interpret, num_warps=num_warps,
                      solve=solve, a_blocks=a_blocks)  # fmt: skip
            if impl == "mosaic":
                kw["state_impl"] = "mosaic"
            return _varlen_packed(q, k, v, g, beta, cu_seqlens, initial_state, kw)
        return _varlen(
            q, k, v, g, beta, cu_seqlens, initial_state,
            dict(scale=scale, use_qk_l2norm=use_qk_l2norm, impl="reference", form=form, chunk_size=chunk_size),
        )  # fmt: skip
    if impl in ("pallas", "mosaic"):
        return _kda_pallas(
            q, k, v, g, beta, initial_state, scale=scale, use_qk_l2norm=use_qk_l2norm, block_v=block_v,
            precision=_pallas_precision(precision, q), interpret=interpret, num_warps=num_warps, solve=solve,
            state_impl="mosaic" if impl == "mosaic" else "triton", a_blocks=a_blocks,
        )  # fmt: skip
    form = form or ("recurrent" if q.shape[1] == 1 else "chunked")
    kw = dict(initial_state=initial_state, scale=scale, use_qk_l2norm=use_qk_l2norm)
    if form == "recurrent":
        return kda_recurrent(q, k, v, g, beta, **kw)
    return kda_chunked(q, k, v, g, beta, chunk_size=chunk_size, **kw)


def _with_states(q, k, v, g, beta, every, cu_seqlens, kw):
    """`kda(..., state_every=every)`: (o, final state, the states after every `every` tokens)."""
    if not isinstance(every, (int, np.integer)) or isinstance(every, bool) or every < 1:
        raise ValueError(f"kda: state_every={every!r} must be a positive int")
    if cu_seqlens is not None:
        raise ValueError("kda: state_every is not taken with cu_seqlens (packed sequences)")
    b, t, n, dk = q.shape
    dv = v.shape[-1]
    count = t // every
    impl = kw["impl"]  # resolved by `kda`
    if count == 0:  # no boundary inside: the plain call and no states
        o, s = kda(q, k, v, g, beta, **kw)
        return o, s, jnp.zeros((b, 0, n, dk, dv), jnp.float32)
    if impl in ("pallas", "mosaic") and every % CHUNK == 0:
        opts = {x: kw[x] for x in ("block_v", "num_warps", "solve", "a_blocks")}
        return _kda_pallas(
            q, k, v, g, beta, kw["initial_state"], scale=kw["scale"], use_qk_l2norm=kw["use_qk_l2norm"],
            precision=_pallas_precision(kw["precision"], q), interpret=kw["interpret"], state_every=every,
            state_impl="mosaic" if impl == "mosaic" else "triton", **opts,
        )  # fmt: skip
    # segments of `every` tokens (the last zero-padded: g = 0, beta = 0 change no state), one call each
    segs = -(-t // every)
    pad = lambda x: jnp.pad(x, [(0, 0), (0, segs * every - t)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
    split = lambda x: jnp.moveaxis(pad(x).reshape(b, segs, every, *x.shape[2:]), 1, 0)  # noqa: E731
    s0 = kw["initial_state"]
    s0 = jnp.zeros((b, n, dk, dv), jnp.float32) if s0 is None else s0.astype(jnp.float32)
    seg_kw = dict(kw, initial_state=None)

    def segment(s, xs):
        o, s = kda(*xs, **dict(seg_kw, initial_state=s))
        return s, (o, s)

    _, (o, states) = jax.lax.scan(segment, s0, tuple(split(x) for x in (q, k, v, g, beta)))
    o = jnp.moveaxis(o, 0, 1).reshape(b, segs * every, n, dv)[:, :t]
    states = jnp.moveaxis(states, 0, 1)  # [B, segs, N, K, V]
    return o, states[:, -1], states[:, :count]


def _pallas_precision(precision, q) -> str:
    """The kernels' product precision: as given, else as precise as the inputs — bf16 operands for bf16 inputs
    (as fla), TF32 otherwise."""
    return precision or ("bf16" if jnp.dtype(q.dtype) == jnp.bfloat16 else "tf32")


def _sequence_offsets(cu_seqlens, q) -> np.ndarray:
    """cu_seqlens validated as host ints rising from 0 to T over a batch of one."""
    if isinstance(cu_seqlens, jax.core.Tracer):
        raise ValueError("kda: cu_seqlens must be concrete host values (they fix the padded shapes)")
    cu = np.asarray(cu_seqlens, np.int64)
    t = q.shape[1]
    if q.shape[0] != 1 or cu.ndim != 1 or cu.size < 2 or cu[0] != 0 or cu[-1] != t or (np.diff(cu) < 0).any():
        raise ValueError(
            f"kda: cu_seqlens={cu.tolist()} must rise from 0 to T={t} over a batch of one (got batch {q.shape[0]})"
        )
    return cu


def _gather_rows(x, src):
    """x [1, T, ...] -> x[0][src] with zeros where src < 0 (padding: g = 0, beta = 0 change no state)."""
    rows = x[0][np.maximum(src, 0)]
    mask = (src >= 0).reshape(src.shape + (1,) * (rows.ndim - src.ndim))
    return jnp.where(mask, rows, jnp.zeros((), rows.dtype))


def _chunk_rows(src):
    """A chunk-aligned layout's slots -> the kernels' row table (`kda_chunked_pallas(rows=)`): src [64·chunks]
    (the token of each slot, -1 for padding; every sequence starts at a chunk boundary, so a chunk's tokens
    are consecutive from its first slot) -> (first token, tokens) per chunk, int32."""
    slots = src.reshape(-1, CHUNK)
    valid = (slots >= 0).sum(axis=1)
    first = np.where(valid > 0, slots[:, 0], 0)
    expect = np.where(np.arange(CHUNK) < valid[:, None], first[:, None] + np.arange(CHUNK), -1)
    if not (slots == expect).all():  # `_varlen_packed` never makes one; a guard for a new layout
        raise AssertionError("kda: a packed layout whose chunks do not hold consecutive tokens from their start")
    return jnp.asarray(first, jnp.int32), jnp.asarray(valid, jnp.int32)


def _varlen(q, k, v, g, beta, cu_seqlens, initial_state, kw):
    """Packed sequences [1, T, ...] -> a padded batch [S, T_max, ...] -> kda -> packed outputs (the jnp
    forms; the Pallas path packs chunk-aligned instead, `_varlen_packed`)."""
    cu = _sequence_offsets(cu_seqlens, q)
    lengths = np.diff(cu)
    steps = np.arange(max(1, int(lengths.max())))
    inside = steps[None, :] < lengths[:, None]  # [S, T_max]
    src = np.where(inside, cu[:-1, None] + steps[None, :], -1)
    o, s = kda(*(_gather_rows(x, src) for x in (q, k, v, g, beta)), initial_state=initial_state, **kw)
    flat = np.nonzero(inside.reshape(-1))[0]  # packed order = row-major over the valid entries
    return o.reshape(-1, *o.shape[2:])[flat][None], s


def _varlen_packed(q, k, v, g, beta, cu_seqlens, initial_state, kw):
    """The Pallas path of a packed batch: each sequence zero-padded to whole 64-token chunks and laid end to
    end ([1, Σ ceil(L_s / 64)·64, ...]: at most 63 pad tokens per sequence, where a batch padded to the
    longest sequence would compute S x T_max; the inputs read in place by phase 1, `kda_chunked_pallas(rows=)`,
    o written by the state pass in the sequences' own rows, `o_rows=`), the state pass (Triton, or Mosaic GPU
    with kw["state_impl"]) starting each sequence from its initial state at its first chunk and writing it out
    at its last (`kda_chunked_pallas(seq_start=, seq_count=)`: one program per sequence, head and V-block)."""
    cu = _sequence_offsets(cu_seqlens, q)
    lengths = np.diff(cu)
    n_seq, n, dk, dv = lengths.size, q.shape[2], q.shape[3], v.shape[3]
    chunks = -(-lengths // CHUNK)  # [S]
    s0 = jnp.zeros((n_seq, n, dk, dv), jnp.float32) if initial_state is None else initial_state
    if s0.shape != (n_seq, n, dk, dv):
        raise ValueError(f"kda: initial_state.shape={s0.shape} must be {(n_seq, n, dk, dv)} for {n_seq} sequences")
    if chunks.sum() == 0:  # nothing to run: every sequence is empty
        return jnp.zeros(v.shape, q.dtype), s0.astype(jnp.float32)
    start = np.cumsum(chunks) - chunks  # first chunk of each sequence
    src = _pack_index(start * CHUNK, lengths, int(chunks.sum()) * CHUNK)
    seq_chunks = (jnp.asarray(start, jnp.int32), jnp.asarray(chunks, jnp.int32))
    o_rows = (jnp.asarray(cu[:-1], jnp.int32), jnp.asarray(lengths, jnp.int32))  # o in the sequences' own rows
    return _kda_pallas(q, k, v, g, beta, s0, seq_chunks=seq_chunks, rows=_chunk_rows(src), o_rows=o_rows, **kw)


def _pack_index(starts, lengths, total: int):
    """Sequence i's tokens at packed slots [starts_i, starts_i + lengths_i) of `total` -> src [total]: the token
    of each slot, -1 for padding (`_chunk_rows`)."""
    token_slot = np.concatenate([np.arange(int(a), int(a) + int(n)) for a, n in zip(starts, lengths, strict=True)])
    src = np.full(total, -1)
    src[token_slot] = np.arange(token_slot.size)
    return src


def _mosaic_why_not(q, precision) -> str | None:
    """What the Mosaic GPU state pass needs that this call lacks (None: it can take it): for "auto"
    (`registry._kda_prefill_pick`) and, as a ValueError, for impl="mosaic" (`_check_mosaic`). Packed
    sequences take it as one sequence does (`_varlen_packed`: one Mosaic program per sequence)."""
    kmax = max(state_mosaic.HEAD_DIMS)
    if jnp.dtype(q.dtype) != jnp.bfloat16:
        return f"bfloat16 inputs (got {jnp.dtype(q.dtype).name})"
    if _pallas_precision(precision, q) != "bf16":
        return f"bf16 products (got precision={precision!r})"
    if q.shape[-1] > kmax:
        return f"K <= {kmax} (got {q.shape[-1]})"
    return None


def _check_mosaic(q, precision: str, interpret) -> None:
    """impl="mosaic"'s one-line refusals, naming what the call has (the kernel re-checks the padded shapes)."""
    why = _mosaic_why_not(q, precision)
    if why is not None:
        raise ValueError(f"kda: impl='mosaic' needs {why}")
    if not interpret and not registry.is_sm90():
        raise ValueError(
            f"kda: impl='mosaic' needs a Hopper (sm_90) GPU or interpret=True (found {registry.device_text()})"
        )


def _kda_pallas(
    q, k, v, g, beta, initial_state, *, scale, use_qk_l2norm, block_v, precision, interpret, num_warps,
    solve="neumann", seq_chunks=None, state_every=None, state_impl="triton", a_blocks=(), rows=None,
    o_rows=None,
):  # fmt: skip
    """Pads to the kernels' constraints (T a multiple of 64; K, V powers of two >= 16, >= 64 for the Mosaic GPU
    state pass, `state_impl="mosaic"`), runs, unpads.
    Padded tokens have g = 0 and beta = 0 and padded channels are zero: the state and outputs are unchanged.
    seq_chunks: (first chunk, chunk count) per chunk-aligned packed sequence; initial_state then [S,N,K,V].
    state_every (a multiple of 64): the states after every state_every tokens come back third.
    rows (`_chunk_rows`) with o_rows (each sequence's first token and tokens): packed inputs read in place and
    o written in their rows, `kda_chunked_pallas`'s (no time padding)."""
    b, t, n, dk = q.shape
    dv = v.shape[-1]
    if block_v <= 0 or block_v & (block_v - 1):
        raise ValueError(f"kda: block_v={block_v} must be a positive power of two")
    scale = dk**-0.5 if scale is None else float(scale)
    if g.ndim == 3:
        g = jnp.broadcast_to(g[..., None], q.shape)
    interpret = registry.interpret_default(interpret)
    if state_impl == "mosaic":
        _check_mosaic(q, precision, interpret)
    least = 64 if state_impl == "mosaic" else 16  # the Mosaic kernel's tiles are 64 bf16 columns wide
    pk, pv = max(least, pow2(dk)), max(least, pow2(dv))
    tp = t if rows is not None else -(-t // CHUNK) * CHUNK

    def pad(x, *w):  # none where nothing is added: packed inputs reach the kernels as they are
        widths = [(0, 0), (0, tp - t), *[(0, p) for p in w]]
        return x if not any(hi for _, hi in widths) else jnp.pad(x, widths)

    q, k, g = pad(q, 0, pk - dk), pad(k, 0, pk - dk), pad(g.astype(jnp.float32), 0, pk - dk)
    v, beta = pad(v, 0, pv - dv), pad(beta.astype(jnp.float32), 0)
    if initial_state is None:
        s0 = jnp.zeros((b, n, pk, pv), jnp.float32)  # (packed sequences always pass theirs)
    elif (pk, pv) == (dk, dv):
        s0 = initial_state.astype(jnp.float32)
    else:
        s0 = jnp.pad(initial_state.astype(jnp.float32), [(0, 0), (0, 0), (0, pk - dk), (0, pv - dv)])
    extra = {} if seq_chunks is None else dict(seq_start=seq_chunks[0], seq_count=seq_chunks[1])
    if state_every is not None:  # a boundary inside the padding (T rounded up to 64) is cut off below
        extra["state_every"] = state_every
    if rows is not None:  # packed sequences: o comes back in their own rows, T tokens as given
        extra.update(rows=rows, o_rows=o_rows)
    out = kda_chunked_pallas(
        q, k, v, g, beta, s0,
        scale=scale, l2norm=use_qk_l2norm, block_v=max(16, min(pv, block_v)), precision=precision,
        interpret=interpret, num_warps=num_warps, solve=solve, state_impl=state_impl, a_blocks=a_blocks,
        **extra,
    )  # fmt: skip
    o, s = out[0][:, :t, :, :dv], out[1][:, :, :dk, :dv]
    if state_every is None:
        return o, s
    return o, s, out[2][:, : t // state_every, :, :dk, :dv]


def kda_state_summary(
    k,
    v,
    g,
    beta,
    *,
    use_qk_l2norm=True,
    chunk_size: int = 64,
    impl: str = "auto",
    block_v: int = 64,
    precision: str | None = None,
    interpret: bool | None = None,
):
    """Context-parallel state summary of one sequence shard: (M [B,N,K,K], E [B,N,K,V]) float32 with
    S_end = M S_start + E. impl: "reference" (chunk-wise jnp), "pallas" (`chunked.kda_state_summary_pallas`,
    the prefill's two phases on the augmented state [M | E], its A kernel with `tuning.A_BLOCKS` as `kda`'s
    default) or "auto" (`registry.resolve("kda_summary")`: the kernel is opt-in)."""
    impl = registry.resolve("kda_summary", impl).impl
    if impl != "pallas":
        return _kda_state_summary(k, v, g, beta, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)
    b, t, n, dk = k.shape
    dv = v.shape[-1]
    if g.ndim == 3:
        g = jnp.broadcast_to(g[..., None], k.shape)
    pk, pv = max(16, pow2(dk)), max(16, pow2(dv))
    tp = -(-t // CHUNK) * CHUNK
    pad = lambda x, *w: jnp.pad(x, [(0, 0), (0, tp - t), *[(0, p) for p in w]])  # noqa: E731
    width = pk + pv
    m, e = kda_state_summary_pallas(
        pad(k, 0, pk - dk), pad(v, 0, pv - dv), pad(g.astype(jnp.float32), 0, pk - dk),
        pad(beta.astype(jnp.float32), 0),
        l2norm=use_qk_l2norm, block_v=min(block_v, width & -width), precision=precision or "tf32",
        interpret=registry.interpret_default(interpret), a_blocks=kda_tuning.A_BLOCKS,
    )  # fmt: skip
    return m[:, :, :dk, :dk], e[:, :, :dk, :dv]


def kda_decode_step(
    q,
    k,
    v,
    g,
    beta,
    state,
    *,
    scale=None,
    use_qk_l2norm=True,
    impl: str = "auto",
    block_v: int = 64,
    num_warps: int = 4,
    interpret: bool | None = None,
):
    """One token per sequence: q, k [B,N,K]; v [B,N,V]; g [B,N,K] (per channel) or [B,N] (per head);
    beta [B,N]; state [B,N,K,V] float32 -> (o [B,N,V] in q.dtype, new state [B,N,K,V] float32).

    impl: "reference" (the jnp recurrence), "pallas" (`decode.decode_step_pallas`: one pass over the state,
    updated in place), or "auto" (`registry.resolve("kda_decode")`). `block_v`: state columns per
    Pallas program (a power of two); `num_warps`: Triton warps per program. `interpret` runs the Pallas
    kernel in interpret mode (default: when the default backend is the CPU)."""
    registry.check_impl("kda_decode", impl)
    if q.ndim != 3 or k.shape != q.shape or v.shape[:2] != q.shape[:2] or beta.shape != q.shape[:2]:
        raise ValueError(f"kda_decode_step: inconsistent shapes q={q.shape} k={k.shape} v={v.shape} beta={beta.shape}")
    b, n, dk = q.shape
    dv = v.shape[-1]
    if g.shape not in (q.shape, q.shape[:2]):
        raise ValueError(f"kda_decode_step: g.shape={g.shape} must be {q.shape} or {q.shape[:2]}")
    if state.shape != (b, n, dk, dv):
        raise ValueError(f"kda_decode_step: state.shape={state.shape} != {(b, n, dk, dv)}")
    if block_v <= 0 or block_v & (block_v - 1):
        raise ValueError(f"kda_decode_step: block_v={block_v} must be a positive power of two")
    impl = registry.resolve("kda_decode", impl).impl
    scale = dk**-0.5 if scale is None else float(scale)
    if g.ndim == 2:
        g = jnp.broadcast_to(g[..., None], q.shape)
    if impl == "reference":
        o, s = kda_recurrent(
            q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
            initial_state=state, scale=scale, use_qk_l2norm=use_qk_l2norm,
        )  # fmt: skip
        return o[:, 0], s
    interpret = registry.interpret_default(interpret)
    pk, pv = pow2(dk), pow2(dv)
    if (pk, pv) != (dk, dv):  # Triton blocks are powers of two; zero rows/columns leave the update unchanged
        pad = lambda x, *w: jnp.pad(x, [(0, 0), (0, 0), *[(0, p) for p in w]])  # noqa: E731
        q, k, g, v, state = (
            pad(q, pk - dk),
            pad(k, pk - dk),
            pad(g, pk - dk),
            pad(v, pv - dv),
            pad(state, pk - dk, pv - dv),
        )
    o, s = decode_step_pallas(
        q, k, v, g, beta, state.astype(jnp.float32),
        scale=scale, l2norm=use_qk_l2norm, block_v=min(pv, block_v), interpret=interpret, num_warps=num_warps,
    )  # fmt: skip
    return o[..., :dv], s[:, :, :dk, :dv]


def kda_decode_steps(q, k, v, g, beta, state, *, scale=None, use_qk_l2norm=True, impl: str = "auto", **kw):
    """T tokens one at a time, keeping the state after each: q, k [B,T,N,K]; v [B,T,N,V]; g [B,T,N,K] or
    [B,T,N]; beta [B,T,N]; state [B,N,K,V] -> (o [B,T,N,V] in q.dtype, states [B,T,N,K,V] float32, states[:, t]
    the state after token t).

    What a speculative verify step needs: a few tokens whose every intermediate state is a rollback point.
    It is `kda_decode_step` (same `impl`: the arithmetic of that op applied to the tokens one by one) in a
    `lax.scan`; the chunked form keeps no intermediate states. A token with beta = 0 and g = 0 (padding) leaves
    the state as it was."""
    if q.ndim != 4 or beta.shape != q.shape[:3]:
        raise ValueError(f"kda_decode_steps: q={q.shape} must be [B,T,N,K] with beta={beta.shape} [B,T,N]")

    def step(s, xs):
        o, s = kda_decode_step(*xs, s, scale=scale, use_qk_l2norm=use_qk_l2norm, impl=impl, **kw)
        return s, (o, s)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    _, (o, states) = jax.lax.scan(step, state.astype(jnp.float32), xs)
    return jnp.moveaxis(o, 0, 1), jnp.moveaxis(states, 0, 1)


def decode_layer_uses_kernel(head_dim: int, v_head_dim: int | None = None, qk_channels: int | None = None) -> bool:
    """Whether `kda_decode_layer(impl="auto")` runs the fused kernel here (`registry.resolve`): callers that
    would otherwise run the layer's steps one by one ask first. v_head_dim, qk_channels (N_k·K): Qwen's grouped
    layout (default: Kimi's)."""
    facts = dict(head_dim=head_dim, v_head_dim=v_head_dim or head_dim, qk_channels=qk_channels or head_dim)
    return registry.resolve("kda_decode_layer", **facts).impl != "reference"


def _check_layer(name, q_raw, k_raw, v_raw, conv_state, conv_weights, f, a_log, dt_bias, b_logits, z, norm_weight,
                 state, num_heads, head_dim, scalar_decay, num_k_heads, v_head_dim, gate):  # fmt: skip
    """The shapes of `kda_decode_layer` (per-token inputs [B, ...]) or of `kda_verify_layer` ([B, T, ...]): a
    ValueError naming the value -> (N_k, V, N_k·K)."""
    if gate not in ("sigmoid", "silu"):
        raise ValueError(f"{name}: gate={gate!r} must be 'sigmoid' or 'silu'")
    if num_heads < 1 or head_dim < 1:
        raise ValueError(f"{name}: num_heads={num_heads} and head_dim={head_dim} must be >= 1")
    nk, dv = num_k_heads or num_heads, v_head_dim or head_dim
    if nk < 1 or dv < 1 or num_heads % nk:
        raise ValueError(f"{name}: num_k_heads={nk} must divide num_heads={num_heads} (v_head_dim={dv})")
    lead, c = q_raw.shape[:-1], q_raw.shape[-1]
    b, dims = lead[0], "B" if len(lead) == 1 else "B, T"
    cv = num_heads * dv
    if c != nk * head_dim or k_raw.shape != q_raw.shape or v_raw.shape != (*lead, cv) or z.shape != (*lead, cv):
        raise ValueError(
            f"{name}: q/k/v/z {[x.shape for x in (q_raw, k_raw, v_raw, z)]} must be "
            f"[{dims}, {nk} x {head_dim}] (q, k) and [{dims}, {num_heads} x {dv}] (v, z)"
        )
    if any(x.dtype != q_raw.dtype for x in (k_raw, v_raw, z)):
        raise ValueError(f"{name}: q/k/v/z dtypes {[str(x.dtype) for x in (q_raw, k_raw, v_raw, z)]} must be one")
    channels = 2 * c + cv
    if conv_state.ndim != 3 or conv_state.shape[0] != b or conv_state.shape[2] != channels:
        raise ValueError(f"{name}: conv_state.shape={conv_state.shape} must be [{b}, W-1, {channels}]")
    width = conv_state.shape[1] + 1
    widths = ((width, c), (width, c), (width, cv))
    if len(conv_weights) != 3 or any(w.shape != want for w, want in zip(conv_weights, widths, strict=True)):
        raise ValueError(f"{name}: conv weights {[w.shape for w in conv_weights]} must be {widths}")
    gates = num_heads if scalar_decay else num_heads * head_dim
    if f.shape != (*lead, gates) or dt_bias.shape != (gates,) or a_log.shape != (num_heads,):
        raise ValueError(
            f"{name}: f {f.shape}, dt_bias {dt_bias.shape}, A_log {a_log.shape} must be "
            f"{(*lead, gates)}, {(gates,)}, {(num_heads,)}"
        )
    if state.shape != (b, num_heads, head_dim, dv) or b_logits.shape != (*lead, num_heads):
        raise ValueError(
            f"{name}: state {state.shape} / b_logits {b_logits.shape} must be {(b, num_heads, head_dim, dv)} / "
            f"{(*lead, num_heads)}"
        )
    if norm_weight.shape != (dv,):
        raise ValueError(f"{name}: norm_weight.shape={norm_weight.shape} must be ({dv},)")
    return nk, dv, c


def kda_decode_layer(
    q_raw, k_raw, v_raw, conv_state, conv_weights, f, a_log, dt_bias, b_logits, z, norm_weight, state, valid,
    n_new, *, num_heads: int, head_dim: int, scalar_decay: bool = False, lower_bound: float | None = None,
    eps: float = 1e-6, impl: str = "auto", interpret: bool | None = None, num_warps: int = 4,
    num_k_heads: int | None = None, v_head_dim: int | None = None, gate: str = "sigmoid",
):  # fmt: skip
    """One decode token of a KDA layer from its raw projections to o_proj's input: short conv + SiLU, q / k
    normalisation, decay and β gates (zero on padded rows), the state update and the gated RMSNorm.

    q_raw, k_raw [B, N_k*K], v_raw, z [B, N*V] in the compute dtype; conv_state [B, W-1, 2*N_k*K + N*V]
    (q | k | v channels); conv_weights the (q, k, v) conv kernels [W, channels]; f [B, N*K] decay projection
    ([B, N] with scalar_decay); a_log [N]; dt_bias [N*K] ([N]); b_logits [B, N]; norm_weight [V]; state
    [B, N, K, V] float32; valid [B] bool; n_new [B] tokens this step (0 or 1) -> (y [B, N, V] in q_raw.dtype,
    new conv state, new state). Kimi's layout by default; Qwen's Gated DeltaNet: num_k_heads N_k q / k heads
    (value head n reads head n // (N / N_k)), v_head_dim V, gate "silu" for the output norm (σ by default).
    At B = 1 the projected inputs (q_raw, k_raw, v_raw, f, b_logits, z) may be one-row `projection.SplitK`
    partial sums: the kernel adds them per head where they start on a head boundary (any column for the
    one-per-head b_logits / scalar f); the reference, and the kernel elsewhere, take their `value()`.
    impl: "reference" (`reference.kda_decode_layer_reference`), "pallas" (`layer_decode.decode_layer_pallas`:
    one program per (sequence, head), conv state and state updated in place) or "auto"
    (`registry.resolve("kda_decode_layer", head_dim=...)`)."""
    registry.check_impl("kda_decode_layer", impl)
    projected = (q_raw, k_raw, v_raw, f, b_logits, z)
    for x in projected:
        if isinstance(x, SplitK) and math.prod(x.lead) != 1:
            raise ValueError(f"kda_decode_layer: split-K partial sums are taken for one row only, got {x.shape}")
    # one-row partial sums as [1, width]; the reference and any that do not line up with the heads are added
    q_raw, k_raw, v_raw, f, b_logits, z = (
        dataclasses.replace(x, lead=(1,)) if isinstance(x, SplitK) else x for x in projected
    )
    nk, dv, c = _check_layer(
        "kda_decode_layer", q_raw, k_raw, v_raw, conv_state, conv_weights, f, a_log, dt_bias, b_logits, z,
        norm_weight, state, num_heads, head_dim, scalar_decay, num_k_heads, v_head_dim, gate,
    )  # fmt: skip
    impl = registry.resolve("kda_decode_layer", impl, head_dim=head_dim, v_head_dim=dv, qk_channels=c).impl
    dtype = jnp.dtype(q_raw.dtype)
    if impl == "reference":
        q_raw, k_raw, v_raw, f, b_logits, z = (materialize(x) for x in (q_raw, k_raw, v_raw, f, b_logits, z))
    else:  # partials the kernel reads per head: starts on head boundaries (any column for one-per-head inputs)
        units = (head_dim, head_dim, dv, 1 if scalar_decay else head_dim, 1, dv)
        q_raw, k_raw, v_raw, f, b_logits, z = (
            x if isinstance(x, SplitK) and x.start % unit == 0 else materialize(x)
            for x, unit in zip((q_raw, k_raw, v_raw, f, b_logits, z), units, strict=True)
        )
    args = (q_raw, k_raw, v_raw, conv_state, tuple(conv_weights), f, a_log, dt_bias, b_logits, z, norm_weight,
            state, valid, n_new)  # fmt: skip
    layout = dict(num_k_heads=nk, v_head_dim=dv, gate=gate)
    if impl == "reference":
        return kda_decode_layer_reference(
            *args, num_heads=num_heads, head_dim=head_dim, scalar_decay=scalar_decay, lower_bound=lower_bound,
            eps=eps, **layout,
        )  # fmt: skip
    why = registry.kda_layer_shape_problem(head_dim, dv, c)
    if why is not None:
        raise ValueError(f"kda_decode_layer(impl='pallas'): {why}")
    interpret = registry.interpret_default(interpret)
    return decode_layer_pallas(
        *args, num_heads=num_heads, scalar_decay=scalar_decay,
        lower_bound=None if lower_bound is None else float(lower_bound), eps=float(eps), interpret=interpret,
        num_warps=num_warps, dtype=dtype, **layout,
    )  # fmt: skip


def kda_verify_layer(
    q_raw, k_raw, v_raw, conv_state, conv_weights, f, a_log, dt_bias, b_logits, z, norm_weight, state, valid, *,
    num_heads: int, head_dim: int, scalar_decay: bool = False, lower_bound: float | None = None, eps: float = 1e-6,
    impl: str = "auto", interpret: bool | None = None, num_warps: int = 4, num_k_heads: int | None = None,
    v_head_dim: int | None = None, gate: str = "sigmoid", block_v: int | None = None,
):  # fmt: skip
    """A speculative verify block through a KDA layer: T tokens per sequence, each as `kda_decode_layer` runs
    it, with the conv state and state after every token kept (the rollback points).

    `kda_decode_layer`'s inputs with a token axis: q_raw, k_raw [B, T, N_k*K], v_raw, z [B, T, N*V], f
    [B, T, N*K] ([B, T, N] with scalar_decay), b_logits [B, T, N], valid [B, T] bool (an invalid token leaves
    both states as they are); conv_state, conv_weights, a_log, dt_bias, norm_weight, state as there ->
    (y [B, T, N, V] in q_raw.dtype, conv snapshots [B, T+1, W-1, channels], state snapshots [B, T+1, N, K, V]
    float32), snapshot t the states after t tokens (0: those passed in).
    impl: "reference" (`reference.kda_verify_layer_reference`: T decode-layer references), "pallas"
    (`layer_decode.verify_layer_pallas`: one launch, one program per (sequence, head, block of `block_v` value
    columns, a power of two; default `tuning.VERIFY_BLOCK_V`), the state kept on chip across the block, each
    token's state arithmetic the decode-layer kernel's; the output norm after it), or "auto" (the
    `kda_decode_layer` rule of `registry.resolve`: where the decode-layer kernel runs, this one does)."""
    registry.check_impl("kda_decode_layer", impl)
    if q_raw.ndim != 3 or q_raw.shape[1] < 1:
        raise ValueError(f"kda_verify_layer: q_raw.shape={q_raw.shape} must be [B, T >= 1, N_k x K]")
    b, t = q_raw.shape[:2]
    if valid.shape != (b, t) or valid.dtype != jnp.bool_:
        raise ValueError(f"kda_verify_layer: valid {valid.shape} {valid.dtype} must be bool [{b}, {t}]")
    if block_v is not None and (not isinstance(block_v, int) or block_v < 16 or block_v & (block_v - 1)):
        raise ValueError(f"kda_verify_layer: block_v={block_v!r} must be a power of two >= 16")
    nk, dv, c = _check_layer(
        "kda_verify_layer", q_raw, k_raw, v_raw, conv_state, conv_weights, f, a_log, dt_bias, b_logits, z,
        norm_weight, state, num_heads, head_dim, scalar_decay, num_k_heads, v_head_dim, gate,
    )  # fmt: skip
    impl = registry.resolve("kda_decode_layer", impl, head_dim=head_dim, v_head_dim=dv, qk_channels=c).impl
    args = (q_raw, k_raw, v_raw, conv_state, tuple(conv_weights), f, a_log, dt_bias, b_logits, z, norm_weight, state,
            valid)  # fmt: skip
    layout = dict(num_k_heads=nk, v_head_dim=dv, gate=gate)
    if impl == "reference":
        return kda_verify_layer_reference(
            *args, num_heads=num_heads, head_dim=head_dim, scalar_decay=scalar_decay, lower_bound=lower_bound,
            eps=eps, **layout,
        )  # fmt: skip
    why = registry.kda_layer_shape_problem(head_dim, dv, c)
    if why is not None:
        raise ValueError(f"kda_verify_layer(impl='pallas'): {why}")
    return verify_layer_pallas(
        *args, num_heads=num_heads, scalar_decay=scalar_decay,
        lower_bound=None if lower_bound is None else float(lower_bound), eps=float(eps),
        interpret=registry.interpret_default(interpret), num_warps=num_warps, block_v=block_v, **layout,
    )  # fmt: skip
