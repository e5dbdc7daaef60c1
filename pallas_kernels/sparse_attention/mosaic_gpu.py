"""Sparse MLA for Hopper in Pallas Mosaic GPU: warp-specialized, one 64-head block of one query row per CTA.

    logit[n, s] = scale * (q_latent[n] . c_s + q_rope[n] . k_rope_s),  s in the selected rows
    out[n] = sum_s softmax(logit[n])_s c_s,   lse[n] = log sum_s exp(logit[n, s])

Grid (head blocks of 64, slot rows); each CTA walks its row's selected slots in blocks of BLOCK_K rows, with
STAGES gathered blocks in shared memory. The roles run on separate warpgroups, as in FlashMLA's Hopper design:

- producer (warpgroup 2): gathers the selected rows of the latent pool into shared memory with `cp.async`,
  16 bytes per thread per copy, written straight into the swizzled (8, 64) tiles `wgmma` reads (a TMA copy per
  row is too slow for a gather), and signals each block as soon as it lands.
- consumer 0: S = Q K^T over the full 576 columns (latent + rope; 512 for a NoPE model), the online softmax,
  P (bf16) handed to consumer 1 through shared memory, and O[:, :256] += P V[:, :256].
- consumer 1: O[:, 256:] += P V[:, 256:], rescaled by consumer 0's correction factors.

On an FP8 latent pool (E4M3, a float32 scale per 128 columns, bf16 rope apart) the producer (104 registers; consumer
1 keeps 168) loads each block's E4M3 pieces into registers with plain 16-byte loads, the scales and rope with
`cp.async`, and writes the block converted into the same bf16 stages (inline PTX: E4M3 pairs to f16, times the
scale in float32, to bf16, all exact), so the consumers are unchanged.

Per 64-row block the tensor work is S (64x64x576) and P V (64x64x512) once each: no product is repeated.
Why a second kernel: the Triton kernel (`kernel.py`) stays far below the tensor bound at decode; warpgroups with
one role each overlap the gather, the products and the softmax. The row gather bounds this one; measurements in
docs/performance.md#sparse-mla.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

BLOCK_H = 64  # heads per CTA: the M of one wgmma
BLOCK_K = 64  # selected rows per step
TILE = 64  # bf16 columns per 128-byte swizzled tile
STAGES = 2  # gathered blocks in flight: Q + 2 stages + P fill sm_90's 227 KiB of shared memory
MAX_WIDTH = 576  # latent + rope columns: Q and two stages take 384 bytes a column, and 576 is all that fits
PRODUCER_REGS = 40  # the BF16 gather warpgroup's registers (setmaxnreg); the two consumers take 232 each
# the FP8 producer holds a block's E4M3 pieces in registers (64 a thread); consumer 1 takes the rest of the pool
FP8_PRODUCER_REGS = 104
# registers a thread of the three warpgroups may hold together: the 168 x 384 given at launch (an increase past
# them never completes: setmaxnreg.inc waits for registers no warpgroup releases)
REGISTER_POOL = 504
WG = 128  # threads per warpgroup
# _SMALL: the small float32 vectors share one shared-memory buffer [2 + STAGES + scale rows, 64]: row 0 the
# correction factors (then the final sums), row 1 the log-sum-exp, then the selected slots of each stage (int32
# bits, consumer 0's mask; only stores, loads, shuffles and a bitcast touch them, no float arithmetic that could
# flush or canonicalise them), then an FP8 pool's row scales [L / 128, 64].
FP8_BLOCK = 128  # latent columns per float32 scale of an FP8 cache (`quantize_kv_fp8`'s tile)
LOG2E = math.log2(math.e)


def _plgpu():
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu


def _tiled():
    plgpu = _plgpu()
    return (plgpu.TilingTransform((8, TILE)), plgpu.SwizzleTransform(128))


def _gather_lane():
    """This thread's place in a warpgroup-wide row gather (inside an `inline_mgpu` body): eight threads per
    row, thread t copying 16-byte piece t % 8 of each 128-byte tile row of rows t // 8, t // 8 + 16, ... ->
    (i32 constant maker, piece, its 16-row group, the byte offset of its piece in a swizzled (8, 128-byte)
    tile: row % 8 = group % 8, 128-byte swizzle piece ^ row % 8)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith
    from jax.experimental.mosaic.gpu import utils as mu

    i32 = ir.IntegerType.get_signless(32)
    c32 = lambda v: arith.constant(i32, v)  # noqa: E731
    lane = arith.remui(mu.thread_idx(), c32(WG))
    piece = arith.andi(lane, c32(7))
    group = arith.shrui(lane, c32(3))  # 0..15: rows group, group + 16, ...
    r8 = arith.andi(group, c32(7))  # row % 8 of every row this thread copies
    in_tile = arith.addi(arith.muli(r8, c32(128)), arith.shli(arith.xori(piece, r8), c32(4)))
    return c32, piece, group, in_tile


def _gather_fn(lat: int, rope: int, split_rope: bool):
    """A warpgroup-wide gather of BLOCK_K selected rows into one (BLOCK_K, lat + rope) swizzled stage.

    Eight threads share a row: thread t copies 16-byte piece t % 8 of every 64-column tile of rows
    t // 8, t // 8 + 16, ... — each warp instruction reads whole 128-byte lines of 4 rows. A thread's
    swizzled column (piece ^ row % 8) is then the same for all its rows, so after one index load per row
    every copy address is the row's base plus a constant. Unused slots (-1) copy row 0; consumer 0 masks
    them. The copies are committed as one `cp.async` group.
    """
    plgpu = _plgpu()
    TILED = _tiled()  # noqa: N806
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, memref, nvvm
    from jax.experimental.mosaic.gpu import utils as mu

    width = lat + rope
    tiles = width // TILE
    lanes = 8  # threads per row: 8 x 16 bytes = one 64-column tile row
    row_groups = WG // lanes  # rows copied at once by the warpgroup
    assert BLOCK_K % row_groups == 0 and row_groups % 8 == 0

    arg_types = (plgpu.RefType(), plgpu.RefType(), plgpu.RefType(TILED), plgpu.RefType())
    arg_types += (plgpu.RefType(),) if split_rope else ()

    @plgpu.inline_mgpu(arg_types=arg_types)
    def gather(ctx, idx_ref, idx_copy_ref, dst_ref, lat_ref, *rope_ref):
        del ctx
        i64 = ir.IntegerType.get_signless(64)
        i8 = ir.IntegerType.get_signless(8)
        index = ir.IndexType.get()
        c32, piece, group, in_tile = _gather_lane()
        # (8, 64) tiles row-tile-major, 1,024 bytes each
        dst_base = arith.addi(arith.muli(arith.shrui(group, c32(3)), c32(tiles * 1024)), in_tile)
        dst = mu.getelementptr(mu.memref_ptr(dst_ref), [dst_base], i8)
        piece_bytes = arith.extui(i64, arith.shli(piece, c32(4)))
        global_ptr = llvm.PointerType.get(address_space=1)
        src_lat = llvm.addrspacecast(global_ptr, mu.memref_ptr(lat_ref))
        if split_rope:
            src_rope = llvm.addrspacecast(global_ptr, mu.memref_ptr(rope_ref[0]))
        for rr in range(BLOCK_K // row_groups):
            row = arith.addi(group, c32(rr * row_groups))
            slot = memref.load(idx_ref, [arith.index_cast(index, row)])
            # the block's slots for consumer 0's mask: the row's 8 threads store the same value
            # the slot's bits in the float32 buffer the kernel's small vectors share (`_SMALL`)
            memref.store(arith.bitcast(ir.F32Type.get(), slot), idx_copy_ref, [arith.index_cast(index, row)])
            slot = arith.maxsi(slot, c32(0))
            slot64 = arith.extui(i64, slot)
            row_stride = lat * 2 if split_rope else width * 2
            lat_row = mu.getelementptr(
                src_lat, [arith.addi(arith.muli(slot64, arith.constant(i64, row_stride)), piece_bytes)], i8
            )
            if split_rope:
                rope_row = mu.getelementptr(
                    src_rope, [arith.addi(arith.muli(slot64, arith.constant(i64, rope * 2)), piece_bytes)], i8
                )
            row_dst = (rr * row_groups // 8) * tiles * 1024
            for ct in range(tiles):
                dptr = mu.getelementptr(dst, [row_dst + ct * 1024], i8)
                if split_rope and ct >= lat // TILE:
                    sptr = mu.getelementptr(rope_row, [(ct - lat // TILE) * TILE * 2], i8)
                else:
                    sptr = mu.getelementptr(lat_row, [ct * TILE * 2], i8)
                nvvm.cp_async_shared_global(dptr, sptr, 16, nvvm.LoadCacheModifierKind.CG)
        nvvm.cp_async_commit_group()

    return gather


# E4M3 -> bf16 of one 16-byte piece (16 values, 4 words in $8-$11) times its float32 scale ($12) into 8 words
# of bf16 pairs ($0-$7): E4M3 pairs to f16 pairs (exact), each to float32, the product with the power-of-two
# scale (exact), rounded to bf16 (exact again for quantize_kv_fp8's values). Lower bytes / halves are the
# lower-numbered values, as in the pool; cvt.rn.bf16x2.f32 puts its first operand in the upper half.
_E4M3_PIECE_TO_BF16 = "\n".join(
    [
        "{",
        ".reg .b16 p<8>;",
        ".reg .b32 h<8>;",
        ".reg .b16 f<16>;",
        ".reg .f32 x<16>;",
        *(f"mov.b32 {{p{2 * w}, p{2 * w + 1}}}, ${8 + w};" for w in range(4)),
        *(f"cvt.rn.f16x2.e4m3x2 h{j}, p{j};" for j in range(8)),
        *(f"mov.b32 {{f{2 * j}, f{2 * j + 1}}}, h{j};" for j in range(8)),
        *(f"cvt.f32.f16 x{v}, f{v};" for v in range(16)),
        *(f"mul.f32 x{v}, x{v}, $12;" for v in range(16)),
        *(f"cvt.rn.bf16x2.f32 ${j}, x{2 * j + 1}, x{2 * j};" for j in range(8)),
        "}",
    ]
)


def _fp8_block_fn(lat: int, rope: int):
    """A warpgroup-wide load of BLOCK_K selected FP8 rows straight into one bf16 stage, without staging:
    `_gather_lane`'s mapping (piece t % 8 of rows t // 8 + 16 j). Each thread first puts its rows' slots in
    shared memory (consumer 0's mask) and issues `cp.async` copies of the rope pieces into the stage's rope
    tile and of the rows' float32 scales into `scl_dst` [L / 128, BLOCK_K]; then loads its 16-byte E4M3
    pieces of every scale block into registers (L / 128 x BLOCK_K / 16 of them in flight), waits for the
    copies (a warpgroup barrier: a scale was copied by another thread), converts each piece
    (`_E4M3_PIECE_TO_BF16`) and stores it as two bf16 pieces of the swizzled tiles."""
    plgpu = _plgpu()
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, memref, nvvm, scf
    from jax.experimental.mosaic.gpu import utils as mu

    blocks, tiles = lat // FP8_BLOCK, (lat + rope) // TILE
    row_groups = WG // 8
    assert BLOCK_K % row_groups == 0 and blocks <= 8  # MAX_WIDTH keeps blocks <= 4
    arg_types = (plgpu.RefType(), plgpu.RefType(), plgpu.RefType(_tiled()), plgpu.RefType())
    arg_types += (plgpu.RefType(), plgpu.RefType()) + ((plgpu.RefType(),) if rope else ())

    @plgpu.inline_mgpu(arg_types=arg_types)
    def load_convert(ctx, idx_ref, idx_copy_ref, dst_ref, scl_dst, lat_ref, scl_ref, *rope_ref):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        i64 = ir.IntegerType.get_signless(64)
        i8 = ir.IntegerType.get_signless(8)
        f32 = ir.F32Type.get()
        index = ir.IndexType.get()
        v4 = ir.VectorType.get((4,), i32)
        words8 = llvm.StructType.get_literal([i32] * 8)
        c32, piece, group, in_tile = _gather_lane()
        r8 = arith.andi(group, c32(7))
        tile_row = arith.shrui(group, c32(3))
        global_ptr = llvm.PointerType.get(address_space=1)
        src_lat = llvm.addrspacecast(global_ptr, mu.memref_ptr(lat_ref))
        src_scl = llvm.addrspacecast(global_ptr, mu.memref_ptr(scl_ref))
        dst = mu.memref_ptr(dst_ref)
        row_base = arith.muli(tile_row, c32(tiles * 1024))  # this thread's first row tile of the stage
        # E4M3 piece p of scale block ct = bf16 columns 128 ct + 16 p: tile 2 ct + p // 4, pieces 2 (p % 4)
        # and 2 (p % 4) + 1 of the row, each swizzled by row % 8
        q0 = arith.shli(arith.andi(piece, c32(3)), c32(1))
        q1 = arith.addi(q0, c32(1))
        dst_row = arith.addi(
            row_base, arith.addi(arith.muli(arith.shrui(piece, c32(2)), c32(1024)), arith.muli(r8, c32(128)))
        )
        dst0 = mu.getelementptr(dst, [arith.addi(dst_row, arith.shli(arith.xori(q0, r8), c32(4)))], i8)
        dst1 = mu.getelementptr(dst, [arith.addi(dst_row, arith.shli(arith.xori(q1, r8), c32(4)))], i8)
        scl_base = mu.memref_ptr(scl_dst)
        scl_mine = mu.getelementptr(scl_base, [arith.shli(group, c32(2))], i8)
        scl_copy = mu.getelementptr(
            scl_base, [arith.addi(arith.muli(piece, c32(BLOCK_K * 4)), arith.shli(group, c32(2)))], i8
        )
        has_scale = arith.cmpi(arith.CmpIPredicate.ult, piece, c32(blocks))
        scale_bytes = arith.extui(i64, arith.shli(piece, c32(2)))
        piece_bytes = arith.extui(i64, arith.shli(piece, c32(4)))
        if rope:
            src_rope = llvm.addrspacecast(global_ptr, mu.memref_ptr(rope_ref[0]))
            rope_off = arith.addi(row_base, arith.addi(in_tile, c32((lat // TILE) * 1024)))
            rope_dst = mu.getelementptr(dst, [rope_off], i8)
        slots = []
        for rr in range(BLOCK_K // row_groups):
            row = arith.index_cast(index, arith.addi(group, c32(rr * row_groups)))
            slot = memref.load(idx_ref, [row])
            memref.store(arith.bitcast(f32, slot), idx_copy_ref, [row])  # int32 bits in the float32 buffer
            slots.append(arith.extui(i64, arith.maxsi(slot, c32(0))))  # unused (-1): row 0, masked
        for rr, slot64 in enumerate(slots):  # the small copies first: they land while the pieces load
            stage_off = rr * row_groups // 8 * tiles * 1024
            if rope:
                src = mu.getelementptr(
                    src_rope, [arith.addi(arith.muli(slot64, arith.constant(i64, rope * 2)), piece_bytes)], i8
                )
                dptr = mu.getelementptr(rope_dst, [stage_off], i8)
                nvvm.cp_async_shared_global(dptr, src, 16, nvvm.LoadCacheModifierKind.CG)
            if_op = scf.IfOp(has_scale)
            with ir.InsertionPoint(if_op.then_block):
                src = mu.getelementptr(
                    src_scl, [arith.addi(arith.muli(slot64, arith.constant(i64, blocks * 4)), scale_bytes)], i8
                )
                dptr = mu.getelementptr(scl_copy, [rr * row_groups * 4], i8)
                nvvm.cp_async_shared_global(dptr, src, 4, nvvm.LoadCacheModifierKind.CA)
                scf.yield_([])
        nvvm.cp_async_commit_group()
        pieces = {}
        for rr, slot64 in enumerate(slots):
            lat_row = mu.getelementptr(
                src_lat, [arith.addi(arith.muli(slot64, arith.constant(i64, lat)), piece_bytes)], i8
            )
            for ct in range(blocks):
                pieces[rr, ct] = llvm.load(v4, mu.getelementptr(lat_row, [ct * FP8_BLOCK], i8), alignment=16)
        nvvm.cp_async_wait_group(0)
        mu.warpgroup_barrier()  # every thread's copies have landed (a scale was copied by another thread)
        for (rr, ct), words in pieces.items():
            sptr = mu.getelementptr(scl_mine, [(ct * BLOCK_K + rr * row_groups) * 4], i8)
            sc = llvm.load(f32, sptr, alignment=4)
            ins = [llvm.extractelement(words, arith.constant(i32, w)) for w in range(4)]
            out = llvm.inline_asm(words8, [*ins, sc], _E4M3_PIECE_TO_BF16, "=r," * 8 + "r,r,r,r,f")
            off = rr * row_groups // 8 * tiles * 1024 + 2 * ct * 1024
            for h, dptr in enumerate((dst0, dst1)):
                vec = llvm.mlir_undef(v4)
                for w in range(4):
                    vec = llvm.insertelement(vec, llvm.extractvalue(i32, out, [4 * h + w]), arith.constant(i32, w))
                llvm.store(vec, mu.getelementptr(dptr, [off], i8), alignment=16)

    return load_convert


def _wait_fn(pending: int):
    """Waits until at most `pending` of this thread's `cp.async` groups are in flight, then makes the landed
    bytes visible to `wgmma` (async proxy) across the warpgroup."""
    plgpu = _plgpu()
    from jax._src.lib.mlir.dialects import nvvm
    from jax.experimental.mosaic.gpu import utils as mu

    @plgpu.inline_mgpu()
    def wait(ctx):
        del ctx
        nvvm.cp_async_wait_group(pending)
        mu.commit_shared()  # fence.proxy.async + warpgroup barrier

    return wait


def _store_out(acc, l_use, q_smem, o_ref, start, width):
    """acc / l -> bf16 through Q's shared tiles start/64 ... (Q is no longer read) -> o_ref[:, start:start+width]."""
    plgpu = _plgpu()
    out = (acc / lax.broadcast_in_dim(l_use, acc.shape, [0])).astype(q_smem.dtype)
    for c in range(width // TILE):
        q_smem[start // TILE + c] = out[:, c * TILE : (c + 1) * TILE]
    plgpu.commit_smem()
    for c in range(width // TILE):
        plgpu.copy_smem_to_gmem(q_smem.at[start // TILE + c], o_ref.at[:, pl.ds(start + c * TILE, TILE)])


def _kernel(
    ql_ref,
    qr_ref,
    idx_ref,
    lat_ref,
    rope_ref,
    scl_ref,
    o_ref,
    lse_ref,
    scratch,
    *,
    lat,
    rope,
    nb,
    scale,
    q_splits,
    split_rope,
    probe,
):
    plgpu = _plgpu()
    fp8 = scl_ref is not None
    q_smem, kv_smem, p_smem, vecs, bars = scratch
    stages = kv_smem.shape[0]
    idx_smem = vecs.at[pl.ds(2, stages)]  # the selected slots of each stage, as float32 bits (`_SMALL`)
    vec_smem, lse_smem = vecs.at[0], vecs.at[1]
    ready, consumed, q_bar, p_ready, p_free, fin = bars
    h = lax.axis_index("h")
    r = lax.axis_index("r")
    wg = lax.axis_index("wg")
    query = lax.div(r, q_splits)
    half = lat // 2
    tiles = (lat + rope) // TILE
    heads = pl.ds(h * BLOCK_H, BLOCK_H)
    c2 = scale * LOG2E  # logits in base 2

    def _producer_fp8():
        # Two bf16 stages as on a BF16 pool: the producer loads block i's E4M3 pieces into registers and writes
        # them converted into stage i % 2 while the consumers work on the other stage.
        plgpu.set_max_registers(FP8_PRODUCER_REGS, action="decrease")
        scl_smem = vecs.at[pl.ds(2 + stages, lat // FP8_BLOCK)]  # the rows' scales
        load_convert = _fp8_block_fn(lat, rope)
        rope_args = (rope_ref,) if rope else ()

        @pl.loop(0, nb)
        def _(i):
            @pl.when(i >= stages)
            def _():
                plgpu.barrier_wait(consumed.at[i % stages])

            block = idx_ref.at[r, pl.ds(i * BLOCK_K, BLOCK_K)]
            if "noconvert" not in probe:
                load_convert(
                    block, idx_smem.at[i % stages], kv_smem.at[i % stages], scl_smem, lat_ref, scl_ref, *rope_args
                )
            plgpu.commit_smem()  # the bf16 tiles visible to wgmma; the scales read before the next block's copies
            plgpu.barrier_arrive(ready.at[i % stages])

    def _producer():
        plgpu.set_max_registers(PRODUCER_REGS, action="decrease")
        gather = _gather_fn(lat, rope, split_rope)
        rows = (lat_ref, rope_ref) if split_rope else (lat_ref,)

        def issue(i):
            block = idx_ref.at[r, pl.ds(i * BLOCK_K, BLOCK_K)]
            if "nogather" not in probe:
                # also copies the slots to shared memory, where consumer 0 reads its mask (vector loads from
                # GMEM are not lowered); a TMA copy of them added its latency to every block's hand-off
                gather(block, idx_smem.at[i % stages], kv_smem.at[i % stages], *rows)

        landed = _wait_fn(0)

        @pl.loop(0, nb)
        def _(i):
            @pl.when(i >= stages)
            def _():
                plgpu.barrier_wait(consumed.at[i % stages])

            issue(i)
            # Signal each block as soon as it lands: signalling block i only after issuing block i + 1
            # (which waits for block i - 1 to be consumed) would run the stages in lockstep.
            landed()
            plgpu.barrier_arrive(ready.at[i % stages])

    pl.when(wg == 2)(_producer_fp8 if fp8 else _producer)

    @pl.when(wg == 0)
    def _softmax_wg():
        plgpu.set_max_registers(232, action="increase")
        for c in range(lat // TILE):
            plgpu.copy_gmem_to_smem(ql_ref.at[query, heads, pl.ds(c * TILE, TILE)], q_smem.at[c], q_bar)
        if rope:  # R = 0 (a NoPE model): the scores are the latent part alone
            plgpu.copy_gmem_to_smem(qr_ref.at[query, heads], q_smem.at[lat // TILE], q_bar)
        plgpu.barrier_wait(q_bar)
        wgmma_rows = plgpu.Layout.WGMMA.reduce(1)
        m = plgpu.layout_cast(jnp.full((BLOCK_H,), -jnp.inf, jnp.float32), wgmma_rows)
        l = plgpu.layout_cast(jnp.full((BLOCK_H,), 0.0, jnp.float32), wgmma_rows)
        acc = plgpu.layout_cast(jnp.zeros((BLOCK_H, half), jnp.float32), plgpu.Layout.WGMMA)

        def step(i, carry):
            acc, m, l = carry
            slot = i % stages
            plgpu.barrier_wait(ready.at[slot])

            def qk(s_ref):
                for c in range(tiles):  # Q is stored tile-major (TMA wants whole tiles), K row-tile-major
                    k_tile = kv_smem.at[slot, :, pl.ds(c * TILE, TILE)]
                    plgpu.wgmma(s_ref, q_smem.at[c], k_tile.transpose((1, 0)))
                return s_ref[...]

            if "nomma" in probe:
                s = plgpu.layout_cast(jnp.zeros((BLOCK_H, BLOCK_K), jnp.float32), plgpu.Layout.WGMMA)
            else:
                s = pl.run_scoped(qk, plgpu.ACC((BLOCK_H, BLOCK_K), jnp.float32))
            idx = plgpu.load(idx_smem.at[i % stages], layout=plgpu.Layout.WGMMA.reduce(0))
            idx = lax.bitcast_convert_type(idx, jnp.int32)
            valid = lax.broadcast_in_dim(idx >= 0, s.shape, [1])
            s = jnp.where(valid, s * c2, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1))
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing seen yet: keep p = 0, no NaN
            alpha = jnp.exp2(m - m_use)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_use, s.shape, [0]))
            l = l * alpha + p.sum(axis=1)
            p16 = p.astype(jnp.bfloat16)

            @pl.when(i > 0)
            def _():
                plgpu.barrier_wait(p_free)

            p_smem[...] = p16
            vec_smem[...] = alpha
            plgpu.commit_smem()
            plgpu.barrier_arrive(p_ready)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p16, kv_smem.at[slot, :, pl.ds(0, half)])

            if "nomma" not in probe:
                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(consumed.at[slot])
            return acc, m_new, l

        acc, m, l = lax.fori_loop(0, nb, step, (acc, m, l))
        l_use = jnp.where(l == 0.0, 1.0, l)
        plgpu.barrier_wait(p_free)  # consumer 1 has read the last alpha
        vec_smem[...] = l_use
        lse_smem[...] = jnp.where(l == 0.0, -jnp.inf, (m + jnp.log2(l_use)) / LOG2E)
        plgpu.commit_smem()
        plgpu.barrier_arrive(fin)
        _store_out(acc, l_use, q_smem, o_ref.at[r, heads], 0, half)
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[r, heads])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _value_wg():
        # its accumulator is 128 registers a thread; beside the FP8 producer it keeps the 168 of the launch
        plgpu.set_max_registers(REGISTER_POOL - 232 - FP8_PRODUCER_REGS if fp8 else 232, action="increase")
        wgmma_rows = plgpu.Layout.WGMMA.reduce(1)
        acc = plgpu.layout_cast(jnp.zeros((BLOCK_H, half), jnp.float32), plgpu.Layout.WGMMA)

        def step(i, acc):
            slot = i % stages
            plgpu.barrier_wait(ready.at[slot])
            plgpu.barrier_wait(p_ready)
            alpha = plgpu.load(vec_smem, layout=wgmma_rows)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p_smem, kv_smem.at[slot, :, pl.ds(half, half)])

            if "nomma" not in probe:
                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(p_free)
            plgpu.barrier_arrive(consumed.at[slot])
            return acc

        acc = lax.fori_loop(0, nb, step, acc)
        plgpu.barrier_wait(fin)
        l_use = plgpu.load(vec_smem, layout=wgmma_rows)
        _store_out(acc, l_use, q_smem, o_ref.at[r, heads], half, half)
        plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("scale", "q_splits", "probe"))
def sparse_mla_mosaic(
    q_latent,
    q_rope,
    slots,
    lat_rows,
    rope_rows=None,
    lat_scales=None,
    *,
    scale: float,
    q_splits: int = 1,
    probe: str = "",
):
    """q_latent [Q,N,L] and q_rope [Q,N,R] bf16, slots [Q*q_splits, K] int32 pool rows (-1 unused),
    lat_rows [rows, L] (+ rope_rows [rows, R]) or lat_rows [rows, L+R] bf16 ->
    (out [Q*q_splits, N, L] bf16, softmax-normalised over each part's rows; lse [Q*q_splits, N] float32).
    FP8 latent cache: `lat_scales` [rows, L/128] float32 with lat_rows [rows, L] in E4M3 and the rope in its own
    bf16 rope_rows (none for R = 0); the producer loads the E4M3 rows and writes them as bf16 tiles (E4M3 x a
    power-of-two scale, `quantize_kv_fp8`'s, is exact in bf16), so the products are the BF16 kernel's.

    Needs N % 64 == 0, K % 64 == 0, R == 64 or R == 0 (no rope part: q_rope [Q,N,0] is not read, no rope pool)
    and L a multiple of 128 (each consumer takes L/2 output columns).
    `probe` is for timing the loop taken apart only (wrong results): "nogather" skips the BF16 row copies,
    "noconvert" the FP8 producer's loads and conversion, "nomma" the products; any may be given.
    """
    plgpu = _plgpu()
    nq, n, lat = q_latent.shape
    rope = q_rope.shape[-1]
    rows_total, k = slots.shape
    fp8 = lat_scales is not None
    split_rope = rope_rows is not None
    bad_rope = rope not in (0, TILE) or (rope == 0 and split_rope) or (fp8 and rope and not split_rope)
    too_wide = lat + rope > MAX_WIDTH
    if n % BLOCK_H or k % BLOCK_K or bad_rope or lat % (2 * TILE) or too_wide or rows_total != nq * q_splits:
        raise ValueError(
            f"sparse_mla_mosaic: needs heads % {BLOCK_H} == 0 (got {n}), selected % {BLOCK_K} == 0 (got {k}), "
            f"rope {TILE} or 0 with no rope rows (got {rope}{', rope rows' if split_rope else ''}; an FP8 latent "
            f"needs its rope rows apart), latent % {2 * TILE} == 0 and latent + rope <= {MAX_WIDTH} (got {lat}), "
            f"{nq} x {q_splits} slot rows "
            f"(got {rows_total})"
        )
    width = lat + rope
    pool_widths = (lat_rows.shape[-1],) + ((rope_rows.shape[-1],) if split_rope else ())
    if pool_widths != ((lat, rope) if split_rope else (width,)):
        raise ValueError(f"sparse_mla_mosaic: pool width(s) {pool_widths} do not match latent {lat} + rope {rope}")
    pool_dtypes = (lat_rows.dtype,) + ((rope_rows.dtype,) if split_rope else ())
    want_dtypes = ((jnp.float8_e4m3fn,) if fp8 else (jnp.bfloat16,)) + ((jnp.bfloat16,) if split_rope else ())
    if pool_dtypes != want_dtypes:
        raise ValueError(
            f"sparse_mla_mosaic: pool dtype(s) {[jnp.dtype(d).name for d in pool_dtypes]}, needs "
            f"{[jnp.dtype(d).name for d in want_dtypes]} (the kernel copies the rows' bytes)"
        )
    if fp8 and lat_scales.shape != (lat_rows.shape[0], lat // FP8_BLOCK):
        raise ValueError(
            f"sparse_mla_mosaic: an FP8 latent needs float8_e4m3fn rows (got {lat_rows.dtype}) and float32 scales "
            f"[rows, L / {FP8_BLOCK}] = {(lat_rows.shape[0], lat // FP8_BLOCK)} (got {tuple(lat_scales.shape)})"
        )
    tiled = _tiled()
    scratch = [
        plgpu.SMEM((width // TILE, BLOCK_H, TILE), jnp.bfloat16, transforms=tiled),  # Q by tile, then the output
        plgpu.SMEM((STAGES, BLOCK_K, width), jnp.bfloat16, transforms=tiled),  # gathered (converted) rows
        plgpu.SMEM((BLOCK_H, BLOCK_K), jnp.bfloat16, transforms=tiled),  # P for consumer 1
        # `_SMALL`: every buffer takes whole 1 KiB granules, and two bf16 stages leave room for one more
        plgpu.SMEM((2 + STAGES + (lat // FP8_BLOCK if fp8 else 0), BLOCK_K), jnp.float32),
    ]
    barriers = (
        plgpu.Barrier(num_arrivals=1, num_barriers=STAGES),  # ready: the producer
        plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),  # consumed: both consumers
        plgpu.Barrier(num_arrivals=width // TILE),  # Q: a TMA copy per tile
        plgpu.Barrier(num_arrivals=1),  # P ready
        plgpu.Barrier(num_arrivals=1),  # P read
        plgpu.Barrier(num_arrivals=1),  # final sums
    )
    kernel = functools.partial(
        _kernel,
        lat=lat,
        rope=rope,
        nb=k // BLOCK_K,
        scale=scale,
        q_splits=q_splits,
        split_rope=split_rope,
        probe=probe,
    )
    n_scratch = len(scratch)

    def entry(ql, qr, idx, lr, rr, sr, o, lse):
        def body(*s):
            kernel(ql, qr, idx, lr, rr, sr, o, lse, (*s[:n_scratch], s[n_scratch:]))

        pl.run_scoped(body, *scratch, *barriers, collective_axes="wg")

    # the call's operands: queries (q_rope only with a rope part), slots, pool(s), then the FP8 scales
    has_qr, has_rr = bool(rope), split_rope

    def entry_any(*refs):
        refs = list(refs)
        ql = refs.pop(0)
        qr = refs.pop(0) if has_qr else None
        idx, lr = refs.pop(0), refs.pop(0)
        rr = refs.pop(0) if has_rr else None
        sr = refs.pop(0) if fp8 else None
        o, lse = refs
        entry(ql, qr, idx, lr, rr, sr, o, lse)

    out_type = (
        jax.ShapeDtypeStruct((rows_total, n, lat), jnp.bfloat16),
        jax.ShapeDtypeStruct((rows_total, n), jnp.float32),
    )
    call = plgpu.kernel(
        entry_any,
        out_type=out_type,
        grid=(n // BLOCK_H, rows_total),
        grid_names=("h", "r"),
        num_threads=3,
        thread_name="wg",
        # The row reductions of the WGMMA layout stay within a warp: no shared scratch for them, which
        # keeps Q + two stages + P within the 227 KiB.
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
    )
    args = (q_latent,) + ((q_rope,) if rope else ()) + (slots, lat_rows) + ((rope_rows,) if split_rope else ())
    args += (lat_scales.astype(jnp.float32),) if fp8 else ()
    return call(*args)
