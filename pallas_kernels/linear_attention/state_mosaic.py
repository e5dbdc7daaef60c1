"""The chunked KDA prefill's state pass (phase 2 of `chunked.py`) in Pallas Mosaic GPU, for Hopper (sm_90).

Per chunk of C = 64 tokens, with the phase-1 intermediates W, U, q_g, k_g [C, K], A_qk [C, C] and the
per-channel chunk decay exp(G_C) [K] (all as `chunked._state_kernel` reads them):

    V' = U − W S;   o = q_g S + A_qk V';   S ← Diag(exp(G_C)) S + k_gᵀ V'

Grid (B, N, V / 64): one warpgroup per (row, head, 64 value columns) walks the chunks in order with S
[K, 64] float32 in registers (the WGMMA accumulator layout). Every product is one `wgmma` from shared
memory: S and V' are written there in bfloat16 for it (the rounding `precision="bf16"` gives the Triton
kernel: bf16 operands, float32 sums), and k_gᵀ is the transposed view of k_g's tile. The chunk's inputs
arrive by TMA through `plgpu.emit_pipeline` in `STAGES` slots (the next chunk's load overlaps this chunk's
products), so that the only latency left per chunk is the chain S -> W S -> V' -> (o, S), with q_g S issued
beside W S and k_gᵀ V' beside A_qk V' (each product a wgmma group waited for only where its result is read);
o goes out by TMA from two shared-memory slots.

Why: the state pass is a chain of 512 dependent chunk steps at 32K tokens, one program per (head, V-block);
the Triton kernel spends ~2.5 us a step (latency of small products and their layout changes), the whole
pass ~1.3 ms of a 4.2 ms prefill (docs/performance.md#kda-prefill).

Packed sequences (`seqs=`: chunk-aligned, each sequence's chunks consecutive): one warpgroup per (sequence, head,
64 value columns) walks only that sequence's chunks from its own initial state (the pipeline's step count
read from memory), so the sequences' recurrences run side by side, as many programs as one sequence has times
the sequences; the programs come longest sequence first (the grid's first axis, the slowest: Mosaic GPU
launches a row-major grid's last axis fastest), so the long chains start in the first wave. With `o_rows=`
(each sequence's first token and token count in the unpadded packing) o goes straight to the sequences' own
rows instead of the chunk-aligned layout: each whole chunk by TMA at its row; a sequence's partial last chunk
(a TMA store of 64 rows there would overwrite the next sequence's first rows, which another program writes)
to a [S, 64, N, V] side buffer whose valid rows one XLA scatter puts in place after the kernel (~64 rows per
sequence, where unpacking o from the layout moved every row: docs/performance.md, "KDA prefill").

Constraints: bfloat16 intermediates (`precision="bf16"`), K of 64 or 128 (shared memory: two stages of the
five input tiles plus S, V', the two o slots and a float32 [K, 64] buffer fit sm_90's 227 KiB at K = 128),
V a multiple of 64, T a multiple of 64. On a CPU the kernel runs in Mosaic GPU's interpreter (`interpret=True`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

CHUNK = 64
BLOCK_V = 64  # value columns per warpgroup: one 128-byte swizzled bf16 tile wide
TILE = 64  # bf16 columns of one 128-byte swizzled tile
STAGES = 2  # pipeline slots of chunk inputs; 3 would exceed shared memory at K = 128
HEAD_DIMS = (64, 128)  # K the kernel takes


def _plgpu():
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu


def _tiled():
    """The 128-byte swizzled (8, 64) bf16 tiles `wgmma` reads its shared-memory operands from."""
    plgpu = _plgpu()
    return (plgpu.TilingTransform((8, TILE)), plgpu.SwizzleTransform(128))


def unsupported(dk: int, dv: int, t: int, inter_dtype, out_dtype=jnp.bfloat16) -> str | None:
    """Why the Mosaic state pass cannot take this call (None: it can): out_dtype is the output's (it writes
    bfloat16)."""
    if jnp.dtype(inter_dtype) != jnp.bfloat16:
        return f'bfloat16 intermediates (precision="bf16"; got {jnp.dtype(inter_dtype).name})'
    if jnp.dtype(out_dtype) != jnp.bfloat16:
        return f"bfloat16 inputs (it writes o in bfloat16; got {jnp.dtype(out_dtype).name})"
    if dk not in HEAD_DIMS:
        return f"K in {HEAD_DIMS} (got {dk})"
    if dv % BLOCK_V:
        return f"V a multiple of {BLOCK_V} (got {dv})"
    if t % CHUNK:
        return f"T a multiple of {CHUNK} (got {t})"
    return None


def _kernel(*refs, nc, every, packed, o_packed):
    """One (row, head, value block), or with `packed` one (sequence, head, value block): the sequence's first
    chunk, chunk count and index come from the three int32 tables before the usual refs, and with `o_packed`
    its first token and token count in o from two more (and the partial chunks' buffer after the outputs)."""
    plgpu = _plgpu()
    if packed:
        first_ref, count_ref, seq_ref, *refs = refs
    if o_packed:
        tok_ref, len_ref, *refs = refs
    w_ref, u_ref, qg_ref, kg_ref, aqk_ref, gl_ref, s0_ref, o_ref, s_ref, *rest = refs
    extra = 1 if every or o_packed else 0  # the snapshots or the partial chunks' buffer (never both)
    (s16, vn, o_slots, f32, bar) = rest[extra:]
    snap_ref = rest[0] if every else None
    tail_ref = rest[0] if o_packed else None
    wgmma_layout = plgpu.Layout.WGMMA
    b, h, j = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("j")
    cols = pl.ds(j * BLOCK_V, BLOCK_V)
    dk = s0_ref.shape[2]
    first, steps, row, state = 0, nc, b, b  # chunks [first, first + steps) of input row `row`, state `state`
    if packed:  # program b takes the b-th longest sequence
        first, steps, row, state = first_ref[b], count_ref[b], 0, seq_ref[b]
    if o_packed:  # the sequence's rows in o; its last chunk is partial unless its length is whole chunks
        token, partial = tok_ref[b], len_ref[b] % CHUNK != 0

    plgpu.copy_gmem_to_smem(s0_ref.at[state, h, :, cols], f32, bar)
    plgpu.barrier_wait(bar)
    s_init = plgpu.load(f32, layout=wgmma_layout)

    def body(idx, w_s, u_s, qg_s, kg_s, aqk_s, gl_s, s):
        (step,) = idx
        c = step + first  # the chunk in the layout
        # read before the first barrier below: the pipeline refills this chunk's input slots once the body
        # returns, and the barriers order every warp's reads of them before that
        decay = plgpu.load(gl_s, layout=wgmma_layout.reduce(1))
        s16[...] = s.astype(jnp.bfloat16)
        plgpu.commit_smem()

        # Four wgmma groups, each waited for only where its result is needed: q_g S runs while V' is formed,
        # k_gᵀ V' while o is stored. The k_gᵀ V' product goes to a fresh accumulator added to the decayed S
        # (an accumulator initialised from registers is not taken by Mosaic GPU's interpreter).
        def chunk(acc_v, acc_o, acc_s):
            plgpu.wgmma(acc_v, w_s, s16)
            plgpu.wgmma(acc_o, qg_s, s16)
            w_state = plgpu.wgmma_accumulator_load(acc_v, wait_n=1)  # W S done; q_g S may still run
            v_new = plgpu.load(u_s, layout=wgmma_layout).astype(jnp.float32) - w_state
            vn[...] = v_new.astype(jnp.bfloat16)
            plgpu.commit_smem()
            plgpu.wgmma(acc_o, aqk_s, vn)  # o = q_g S + A_qk V'
            plgpu.wgmma(acc_s, kg_s.transpose((1, 0)), vn)
            o = plgpu.wgmma_accumulator_load(acc_o, wait_n=1)  # k_gᵀ V' may still run
            slot = o_slots.at[step % 2]
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # this slot's copy of two chunks ago has read it
            slot[...] = o.astype(slot.dtype)
            plgpu.commit_smem()
            if not o_packed:
                plgpu.copy_smem_to_gmem(slot, o_ref.at[row, pl.ds(c * CHUNK, CHUNK), h, cols])
                return plgpu.wgmma_accumulator_load(acc_s, wait_n=0)
            to_tail = partial & (step == steps - 1)  # one copy either way: one bulk group a chunk

            @pl.when(to_tail)
            def _():
                plgpu.copy_smem_to_gmem(slot, tail_ref.at[state, :, h, cols])

            @pl.when(jnp.logical_not(to_tail))
            def _():
                plgpu.copy_smem_to_gmem(slot, o_ref.at[0, pl.ds(token + step * CHUNK, CHUNK), h, cols])

            return plgpu.wgmma_accumulator_load(acc_s, wait_n=0)

        update = pl.run_scoped(
            chunk,
            plgpu.ACC((CHUNK, BLOCK_V), jnp.float32),
            plgpu.ACC((CHUNK, BLOCK_V), jnp.float32),
            plgpu.ACC((dk, BLOCK_V), jnp.float32),
        )
        s = s * lax.broadcast_in_dim(decay, s.shape, [0]) + update  # S ← Diag(exp(G_C)) S + k_gᵀ V'
        if every:

            @pl.when((c + 1) % every == 0)
            def _():
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last snapshot's copy out of `f32`
                f32[...] = s
                plgpu.commit_smem()
                snap = (c + 1) // every - 1
                plgpu.copy_smem_to_gmem(f32, snap_ref.at[b, h, pl.ds(snap * dk, dk), cols])

        return s

    tiled = _tiled()
    tile = lambda width: plgpu.BlockSpec((CHUNK, width), lambda c: (c + first, 0), transforms=tiled)  # noqa: E731
    gate = plgpu.BlockSpec((None, dk), lambda c: (c + first, 0))  # exp(G_C) of the chunk [K]
    s_end = plgpu.emit_pipeline(
        body,
        grid=(steps,),  # read from memory with packed sequences: a sequence of no chunk runs no step
        in_specs=[tile(dk), tile(BLOCK_V), tile(dk), tile(dk), tile(CHUNK), gate],
        max_concurrent_steps=STAGES,
        init_carry=s_init,
    )(
        w_ref.at[row, :, h, :],
        u_ref.at[row, :, h, cols],
        qg_ref.at[row, :, h, :],
        kg_ref.at[row, :, h, :],
        aqk_ref.at[row, :, h, :],
        gl_ref.at[row, :, h, :],
    )
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    f32[...] = s_end
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(f32, s_ref.at[state, h, :, cols])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("state_every", "interpret", "o_tokens"))
def kda_state_pass_mosaic(
    w, u, qg, kg, aqk, gl, s0, *, state_every: int | None = None, interpret=False, seqs=None,
    o_rows=None, o_tokens: int | None = None,
):  # fmt: skip
    """The state pass over phase 1's intermediates: w, qg, kg [B, T, N, K], u [B, T, N, V], aqk [B, T, N, 64]
    (bfloat16); gl [B, T / 64, N, K, 1] float32 (exp(G_C) per chunk); s0 [B, N, K, V] float32 ->
    (o [B, T, N, V] bfloat16, final state [B, N, K, V] float32), and with state_every (a multiple of 64) the
    states after every state_every tokens [B, N, (T // state_every)·K, V] float32 (snapshot j in rows
    [j·K, (j+1)·K), the layout of `chunked.kda_chunked_pallas`'s state kernel).
    `unsupported` lists the constraints; a call outside them is a ValueError naming the value.
    interpret: False (compile for the GPU), True (Mosaic GPU's interpreter) or a `plgpu.InterpretGPUParams`
    (the interpreter with those settings, e.g. its race detector).
    seqs (first chunk, chunk count) int32 [S]: packed sequences in a batch of one (each sequence's chunks
    consecutive in the layout; chunks of none are not read and their o rows not written): s0 and the final
    states are then [S, N, K, V], a sequence of no chunk keeps its s0; not with state_every.
    o_rows (first token, tokens) int32 [S] with seqs, and o_tokens (static int, the tokens of all sequences):
    o comes back unpadded, [1, o_tokens, N, V], sequence s in rows [first token_s, first token_s + tokens_s)
    (its chunk count ceil(tokens_s / 64); rows no sequence holds are left unwritten)."""
    plgpu = _plgpu()
    b, t, n, dk = w.shape
    dv = u.shape[-1]
    n_seq = b if seqs is None else s0.shape[0]
    why = unsupported(dk, dv, t, w.dtype)
    shapes_ok = (
        u.shape == (b, t, n, dv)
        and qg.shape == kg.shape == w.shape
        and aqk.shape == (b, t, n, CHUNK)
        and gl.shape == (b, t // CHUNK, n, dk, 1)
        and s0.shape == (n_seq, n, dk, dv)
    )
    o_packed = o_rows is not None or o_tokens is not None
    if why is None and o_packed:
        ok = seqs is not None and o_rows is not None and isinstance(o_tokens, int) and o_tokens > 0 and len(o_rows) == 2
        if not ok or any(x.shape != (n_seq,) or x.dtype != jnp.int32 for x in o_rows):
            got = None if o_rows is None else [(x.shape, x.dtype.name) for x in o_rows]
            why = f"o_rows as two int32 [S] arrays with seqs and a positive o_tokens (got {got}, o_tokens {o_tokens!r})"
    if why is None and seqs is not None:
        ok = b == 1 and all(x.shape == (n_seq,) and x.dtype == jnp.int32 for x in seqs) and len(seqs) == 2
        if not ok or state_every is not None:
            got = [(x.shape, x.dtype.name) for x in seqs]
            why = (f"packed sequences as two int32 [S] arrays over a batch of one, without state_every "
                   f"(got seqs {got}, batch {b}, state_every {state_every})")  # fmt: skip
    dtypes_ok = all(x.dtype == jnp.bfloat16 for x in (u, qg, kg, aqk)) and gl.dtype == s0.dtype == jnp.float32
    if why is None and not shapes_ok:
        why = (f"consistent shapes (w {w.shape}, u {u.shape}, qg {qg.shape}, kg {kg.shape}, aqk {aqk.shape}, "
               f"gl {gl.shape}, s0 {s0.shape})")  # fmt: skip
    if why is None and not dtypes_ok:
        named = {"w": w, "u": u, "qg": qg, "kg": kg, "aqk": aqk, "gl": gl, "s0": s0}
        got = ", ".join(f"{name} {x.dtype}" for name, x in named.items())
        why = f"bfloat16 w, u, qg, kg, aqk and float32 gl, s0 (got {got})"
    if why is None and state_every is not None and (state_every <= 0 or state_every % CHUNK):
        why = f"state_every a positive multiple of {CHUNK} (got {state_every})"
    if why is not None:
        raise ValueError(f"kda_state_pass_mosaic: needs {why}")
    nc = t // CHUNK
    every = 0 if state_every is None else state_every // CHUNK
    count = 0 if state_every is None else t // state_every
    tiled = _tiled()
    scratch = (
        plgpu.SMEM((dk, BLOCK_V), jnp.bfloat16, transforms=tiled),  # S in bf16: the products' operand
        plgpu.SMEM((CHUNK, BLOCK_V), jnp.bfloat16, transforms=tiled),  # V' in bf16
        # o, two slots copied out by TMA; untiled where o's rows start anywhere (a tiled slot's TMA store needs
        # its row offset a multiple of the 8-row tile)
        plgpu.SMEM((2, CHUNK, BLOCK_V), jnp.bfloat16, transforms=() if o_packed else tiled),
        plgpu.SMEM((dk, BLOCK_V), jnp.float32),  # S in float32: in (s0), out (snapshots, final state)
        plgpu.Barrier(num_arrivals=1),
    )
    # o's rows: at least one chunk, so that a whole chunk's TMA store has a row range to address (its copy
    # never runs where the sequences hold fewer tokens in all; the rows past o_tokens are sliced off)
    o_shape = (1, max(o_tokens, CHUNK), n, dv) if o_packed else u.shape
    out_type = [jax.ShapeDtypeStruct(o_shape, jnp.bfloat16), jax.ShapeDtypeStruct(s0.shape, jnp.float32)]
    if every:
        out_type.append(jax.ShapeDtypeStruct((b, n, count * dk, dv), jnp.float32))
    if o_packed:  # each sequence's partial last chunk, put in place below
        out_type.append(jax.ShapeDtypeStruct((n_seq, CHUNK, n, dv), jnp.bfloat16))
    kernel = functools.partial(_kernel, nc=nc, every=every, packed=seqs is not None, o_packed=o_packed)

    def kda_state_mosaic(*refs):  # named for profiles: the kernel takes its body's name
        pl.run_scoped(lambda *s: kernel(*refs, *s), *scratch)

    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    kw = dict(interpret=interpret) if interpret else {}
    tables = ()
    if seqs is not None:  # program b takes the b-th longest sequence: the long chains start in the first wave
        order = jnp.argsort(-seqs[1], stable=True).astype(jnp.int32)
        tables = (seqs[0][order], seqs[1][order], order)
        if o_packed:
            tables += (o_rows[0][order], o_rows[1][order])
    # the first axis slowest (row-major: Mosaic GPU launches the last axis fastest)
    grid = dict(grid=(n_seq, n, dv // BLOCK_V), grid_names=("b", "h", "j"))
    out = plgpu.kernel(kda_state_mosaic, out_type=tuple(out_type), **grid, **kw)(
        *tables, w, u, qg, kg, aqk, gl.reshape(b, t // CHUNK, n, dk), s0
    )
    if not o_packed:
        return out
    o, s, tail = out
    # row i of sequence s's buffer is its token (tokens_s // 64)·64 + i: those below tokens_s go in place, the
    # rest (and every row of a sequence without a partial chunk) to distinct rows past o's end, dropped
    first, tokens = o_rows
    i = jnp.arange(CHUNK, dtype=jnp.int32)
    inside = i[None, :] < (tokens % CHUNK)[:, None]
    beyond = o.shape[1] + jnp.arange(n_seq * CHUNK, dtype=jnp.int32).reshape(n_seq, CHUNK)
    dest = jnp.where(inside, (first + tokens // CHUNK * CHUNK)[:, None] + i[None, :], beyond)
    o = o.at[0, dest.reshape(-1)].set(tail.reshape(n_seq * CHUNK, n, dv), mode="drop", unique_indices=True)
    return o[:, :o_tokens], s
