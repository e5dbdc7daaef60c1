"""Multi-head Latent Attention and the DSA lightning indexer (docs/architecture.md §5, §6)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybrid_jax import inspect
from hybrid_jax.cache import MLAState, Pool, StepInfo, is_concrete, store_rows
from hybrid_jax.config import HybridConfig
from hybrid_jax.layers.common import DTypes, LayerNorm, RMSNorm, dense_kernel, linear, own_kernels, project_many
from hybrid_jax.layers.rope import apply_rope, attention_factor, inv_frequencies, rope_tables
from hybrid_jax.quant.config import QuantConfig
from pallas_kernels.attention import attention
from pallas_kernels.indexer import (
    expand_pools,
    indexer_prolog,
    indexer_topk,
    kpool_compress,
    pool_query_positions,
    prolog_uses_kernel,
)
from pallas_kernels.mla_decode import mla_decode
from pallas_kernels.paged import gather_pages
from pallas_kernels.sparse_attention import sparse_mla

HIGHEST = jax.lax.Precision.HIGHEST
# Keys per block of a dense MLA prefill against a cache that spans more than this: the cached latents are expanded
# through kv_b_proj one block at a time and the blocks' attention merged by LSE, so a prefill chunk's
# temporaries are one block's whatever the cache holds (expanding all of it took 15 GiB at a 1M-token cache).
PREFILL_KEY_BLOCK = 16384


def _visible(rows: jax.Array, lengths: jax.Array) -> jax.Array:
    """rows [B, S, ...] cut to the longest sequence's `lengths` when that is known (eager recording); under a
    trace (`record_indexer(traced=True)`) all S rows, the ones past a sequence's length masked as causal."""
    return rows[:, : int(lengths.max())] if is_concrete(lengths) else rows


class LightningIndexer(nnx.Module):
    """Chooses, per query token, the Top-K earlier positions that a sparse MLA layer reads.

        q_I = W_qb^I c_q  -> [N_I, H_I];   k_I = LayerNorm(W_k^I x) -> [H_I]   (shared by all heads)
        RoPE (half-split) on the first `index_rope_dim` dims of q_I and k_I
        w = (W_w x) N_I^-1/2   (float32)
        I[t, s] = Σ_h w_h(t) ReLU(H_I^-1/2 q_I,h(t) · k_I(s)),  causal;  keep the Top-K positions
    `c_q` is the MLA query latent (q_a_layernorm output) or x itself when the model has no q-LoRA.

    KPool (`index_kpool` = P > 1, GLM-5.3-Flash): the keys are compressed per pool of P tokens,
        key_j = Σ_s softmax_s(W_g x_{jP+s} + ape_s) ⊙ k_I(jP+s)        (per channel; pallas_kernels/indexer/kpool.py)
    a query scores the complete pools only, keeps the best topk / P, and reads their tokens plus (when
    `index_kpool_always_select_tail`) its own incomplete pool's. The cache keeps one pooled key per pool and
    the raw keys | gate logits of the pool still filling up (`MLAState.index_tail`).
    """

    def __init__(self, cfg: HybridConfig, dt: DTypes, quant: QuantConfig, *, rngs: nnx.Rngs):
        self.cfg, self.dt = cfg, dt
        self.fmt = "mxfp8" if quant.indexer.enabled else "dense"
        q_in = cfg.q_lora_rank or cfg.hidden_size
        nh, hd = cfg.index_num_heads, cfg.index_head_dim
        self.wq_b = linear(q_in, nh * hd, ("q_lora", "index_heads"), dt, rngs)
        self.wk = linear(cfg.hidden_size, hd, ("embed", None), dt, rngs)
        self.k_norm = LayerNorm(hd, eps=cfg.index_norm_eps, dt=dt)
        self.weights_proj = nnx.Linear(
            cfg.hidden_size,
            nh,
            use_bias=False,
            dtype=jnp.float32,
            param_dtype=jnp.float32,
            kernel_init=nnx.with_metadata(nnx.initializers.normal(0.02), logical_axes=("embed", "index_heads")),
            rngs=rngs,
        )
        self.kpool = cfg.index_kpool
        if self.kpool > 1:
            self.index_kpool_compress_gate = linear(cfg.hidden_size, hd, ("embed", None), dt, rngs)
            self.index_kpool_compress_ape = nnx.Param(
                0.1 * jax.random.normal(rngs.params(), (self.kpool, hd), jnp.float32), logical_axes=(None, None)
            )

    def _rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        r = self.cfg.index_rope_dim
        if r == 0:
            return x
        cfg = self.cfg
        inv = inv_frequencies(r, cfg.rope_theta, cfg.rope_scaling)
        rot = apply_rope(x[..., :r], positions, inv, interleaved=False, factor=attention_factor(cfg.rope_scaling))
        return jnp.concatenate([rot, x[..., r:]], axis=-1)

    def _fused_prolog(self, x: jax.Array, c_q: jax.Array, info: StepInfo):
        """(q, k, w) through `indexer_prolog`'s one-launch kernel when it takes this call (decode-sized rows,
        plain bf16 projection kernels — not FP8-resident ones — and the kernel asked for with
        `use_pallas(ops=["indexer_prolog"])`: an explicit opt-in, measured slower than XLA), else None."""
        cfg = self.cfg
        b, t, d = x.shape
        nh, hd, r = cfg.index_num_heads, cfg.index_head_dim, cfg.index_rope_dim
        plain = isinstance(self.wq_b, nnx.Linear) and isinstance(self.wk, nnx.Linear)
        if not (plain and prolog_uses_kernel(b * t, c_q.shape[-1], d, nh, hd, r)):
            return None
        inv = inv_frequencies(r, cfg.rope_theta, cfg.rope_scaling) if r else np.zeros((0,), np.float32)
        cos, sin = rope_tables(info.positions, inv, attention_factor(cfg.rope_scaling))
        q, k, w = indexer_prolog(
            x.reshape(b * t, d), c_q.reshape(b * t, -1), self.wq_b.kernel[...], self.wk.kernel[...],
            self.k_norm.weight[...], self.k_norm.bias[...], self.weights_proj.kernel[...],
            cos.reshape(b * t, -1), sin.reshape(b * t, -1), num_heads=nh, rope_dim=r, eps=cfg.index_norm_eps,
            impl="pallas",
        )  # fmt: skip
        return q.reshape(b, t, nh, hd), k.reshape(b, t, hd), w.reshape(b, t, nh)

    def prolog(self, x: jax.Array, c_q: jax.Array, info: StepInfo, pool: Pool | None):
        """Everything before the scores: (q [B,T,N_I,H_I] with RoPE (its MXFP8 image when quantized),
        head weights w [B,T,N_I] float32, the key pool with this call's normalised, rotated keys written).
        The modules step by step, or (opt-in, decode) one fused kernel (`indexer_prolog`)."""
        cfg = self.cfg
        b, t, _ = x.shape
        fused = self._fused_prolog(x, c_q, info)
        if fused is not None:
            q, k, w = fused
        else:
            q = self._rope(self.wq_b(c_q).reshape(b, t, cfg.index_num_heads, cfg.index_head_dim), info.positions)
            k = self._rope(self.k_norm(self.wk(x)), info.positions)  # [B,T,H_I]
            w = self.weights_proj(x.astype(jnp.float32)) * cfg.index_num_heads**-0.5
        if self.fmt == "mxfp8":
            q = Pool.from_rows(q, "mxfp8", 0, q.dtype).read(q.dtype)
        return q, w, store_rows(pool, k, info, self.fmt, 0)

    def init_state(self, num_pages: int, page_size: int, batch_size: int, dtype) -> tuple[Pool, jax.Array | None]:
        """(the key pool, the KPool tail [B, P, 2 H_I] or None). KPool: pages of page_size / P slots, so that pool
        j's key lives in the page of its tokens (slot j mod page_size / P) and the pool takes 1/P of the memory."""
        hd = self.cfg.index_head_dim
        pool = Pool.empty(num_pages, page_size // self.kpool, hd, dtype, self.fmt)
        tail = jnp.zeros((batch_size, self.kpool, 2 * hd), dtype) if self.kpool > 1 else None
        return pool, tail

    def _pooled(self, x: jax.Array, info: StepInfo, pool: Pool | None, tail: jax.Array | None):
        """KPool keys: this call's tokens joined to the incomplete pool the cache holds; every pool completed
        by them compressed and written at its pool position; the pool left incomplete becomes the new tail.
        -> (the key pool, the new tail, or None without a cache)."""
        p = self.kpool
        k = self.k_norm(self.wk(x))
        g = self.index_kpool_compress_gate(x)
        rows = jnp.concatenate([k, g.astype(k.dtype)], axis=-1)  # [B,T,2H]
        positions, n_new = info.positions, info.n_new
        if info.cp is not None:  # every device compresses the whole sequence (as `_store` gathers keys)
            rows = info.cp.gather_sequence(rows)
            positions = info.cp.gather_sequence(positions)
            n_new = jnp.sum(info.cp.gather_sequence(info.valid), axis=1).astype(jnp.int32)
        b, t, width = rows.shape
        start = positions[:, 0] - (positions[:, 0] % p)  # first token of the pool the call starts in
        off = positions[:, 0] - start  # its tokens already in the tail
        held = jnp.zeros((b, p, width), rows.dtype) if tail is None else tail.astype(rows.dtype)
        m = -(-(p - 1 + t) // p)  # pools the call can touch
        r = jnp.arange(m * p, dtype=jnp.int32)[None, :]
        src = jnp.where(r < off[:, None], r, p + jnp.minimum(r - off[:, None], t - 1))
        ext = jnp.take_along_axis(jnp.concatenate([held, rows], axis=1), src[..., None], axis=1)
        ext = ext.reshape(b, m, p, width)
        keys = kpool_compress(ext[..., : width // 2], ext[..., width // 2 :], self.index_kpool_compress_ape[...])
        keys = keys.astype(self.dt.compute)
        filled = off + n_new  # tokens of the call's pools that exist after it
        complete = (jnp.arange(m, dtype=jnp.int32)[None, :] + 1) * p <= filled[:, None]
        where = dataclasses.replace(info, positions=start[:, None] // p + jnp.arange(m)[None, :], valid=complete)
        if pool is None:
            pool = Pool.from_rows(keys, self.fmt, 0, keys.dtype)
        else:
            pool = pool.write(where, keys)
        if tail is None:
            return pool, None
        per_step = info.mode == "verify" or info.snapshot_every is not None
        if info.mode == "verify":  # the tail after each of 0 .. T tokens: [B, T+1, P, 2H] (HybridLM.commit)
            filled = off[:, None] + jnp.minimum(jnp.arange(t + 1)[None, :], n_new[:, None])
        elif info.snapshot_every is not None:  # after every E tokens, then after all: [B, T // E + 1, P, 2H]
            e = info.snapshot_every
            ends = jnp.minimum((jnp.arange(t // e) + 1)[None, :] * e, n_new[:, None])
            filled = off[:, None] + jnp.concatenate([ends, n_new[:, None]], axis=1)
        else:
            filled = filled[:, None]
        last = jnp.minimum(filled // p, m - 1)  # the pool left incomplete (empty when filled % p == 0)
        new_tail = jnp.take_along_axis(ext, last[:, :, None, None], axis=1)  # [B, S, P, 2H]
        kept = jnp.arange(p)[None, None, :] < (filled % p)[..., None]  # slots past the pool's tokens hold zeros
        new_tail = jnp.where(kept[..., None], new_tail, 0).astype(tail.dtype)
        return pool, new_tail if per_step else new_tail[:, 0]

    def __call__(self, x: jax.Array, c_q: jax.Array, info: StepInfo, pool: Pool | None, tail=None):
        """Returns (indices [B,T,topk] int32 positions, -1 = none, in no promised order; the updated key pool;
        the KPool tail). With MXFP8 on, q and k are scored as their quantize-dequantize images (the kernel's
        arithmetic). KPool: topk + P − 1 positions (the selected pools' tokens, then the query's tail)."""
        cfg = self.cfg
        if self.kpool > 1:
            if pool is not None and tail is None:
                raise ValueError("a KPool indexer with a cached key pool needs its tail (MLAState.index_tail)")
            return self._call_pooled(x, c_q, info, pool, tail)
        q, w, pool = self.prolog(x, c_q, info, pool)
        idx, _ = indexer_topk(  # reads the pool as stored (MXFP8 values + E8M0 scales when quantized)
            q,
            w,
            pool.values,
            info.page_table,
            q_positions=info.positions,
            kv_lengths=info.kv_lengths,
            topk=cfg.index_topk,
            scale=cfg.index_head_dim**-0.5,
            k_scales=pool.scales,
            sort=False,  # sparse MLA reads the chosen rows as a set
        )
        if inspect.recording():  # hybrid_jax.inspect.record_indexer(): a switch read at trace time
            k_seq = _visible(gather_pages(pool.read(self.dt.compute), info.page_table), info.kv_lengths)
            inspect.add_record(
                q=q, k=k_seq, weights=w, scale=cfg.index_head_dim**-0.5, positions=info.positions, indices=idx
            )
        return idx, pool, None

    def _call_pooled(self, x, c_q, info: StepInfo, pool: Pool | None, tail):
        cfg, p = self.cfg, self.kpool
        b, t, _ = x.shape
        q = self.wq_b(c_q).reshape(b, t, cfg.index_num_heads, cfg.index_head_dim)
        w = self.weights_proj(x.astype(jnp.float32)) * cfg.index_num_heads**-0.5
        if self.fmt == "mxfp8":
            q = Pool.from_rows(q, "mxfp8", 0, q.dtype).read(q.dtype)
        pool, tail = self._pooled(x, info, pool, tail)
        q_pool = pool_query_positions(info.positions, p)
        pool_idx, _ = indexer_topk(
            q,
            w,
            pool.values,
            info.page_table,
            q_positions=q_pool,
            kv_lengths=info.kv_lengths // p,
            topk=cfg.index_topk // p,
            scale=cfg.index_head_dim**-0.5,
            k_scales=pool.scales,
            sort=False,
        )
        idx = expand_pools(pool_idx, info.positions, p, tail=cfg.index_kpool_always_select_tail)
        if inspect.recording():
            k_seq = _visible(gather_pages(pool.read(self.dt.compute), info.page_table), info.kv_lengths // p)
            inspect.add_record(
                q=q, k=k_seq, weights=w, scale=cfg.index_head_dim**-0.5, positions=q_pool, indices=pool_idx,
                pool_size=p, token_indices=idx,
            )  # fmt: skip
        return idx, pool, tail


class MultiHeadLatentAttention(nnx.Module):
    """MLA with a compressed KV latent; dense (`full`) or over the indexer's Top-K (`sparse`).

        c_q = RMSNorm(W_qa x) (q-LoRA) ;  [q_nope | q_pe]_n = W_qb c_q   (or W_q x)
        [c_raw | k_pe] = W_kva x ;  c = RMSNorm_1e-6(c_raw) ;  RoPE on q_pe, k_pe (unless NoPE)
        [k_nope | v]_n = W_kvb c ;  k_n = [k_nope_n | k_pe]
        o_n = softmax(scale · q_n k_nᵀ + mask) v_n ;   y = W_o concat_n(o_n ⊙ σ(W_og x)_n)
    Only [c | k_pe] (L+R values) is cached per token. Prefill uses this expanded ("naive") form; decode
    and sparse layers use the absorbed form: q̃_n = W_UK,nᵀ q_nope_n, logits = scale(q̃_n·c + q_pe_n·k_pe),
    o_n = W_UV,n Σ p c (docs/architecture.md §5).
    """

    def __init__(
        self, cfg: HybridConfig, dt: DTypes, quant: QuantConfig, *, sparse: bool, shared: bool = False, rngs: nnx.Rngs
    ):
        self.cfg, self.dt, self.sparse, self.shared = cfg, dt, sparse, shared
        self.latent_fmt = "fp8" if quant.kv_cache.enabled else "dense"
        self.tile = quant.kv_cache.tile_size
        d, n = cfg.hidden_size, cfg.num_heads
        if cfg.q_lora_rank is not None:
            self.q_a_proj = linear(d, cfg.q_lora_rank, ("embed", "q_lora"), dt, rngs)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps=cfg.mla_norm_eps, dt=dt)
            self.q_b_proj = linear(cfg.q_lora_rank, n * cfg.qk_head_dim, ("q_lora", "heads"), dt, rngs)
        else:
            self.q_proj = linear(d, n * cfg.qk_head_dim, ("embed", "heads"), dt, rngs)
        self.kv_a_proj_with_mqa = linear(d, cfg.latent_dim, ("embed", None), dt, rngs)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, eps=cfg.mla_norm_eps, dt=dt)
        self.kv_b_proj = linear(
            cfg.kv_lora_rank, n * (cfg.qk_nope_head_dim + cfg.v_head_dim), ("kv_lora", "heads"), dt, rngs
        )
        self.o_proj = linear(n * cfg.v_head_dim, d, ("heads", "embed"), dt, rngs)
        if cfg.mla_output_gate:
            self.output_gate_proj = linear(d, n * cfg.v_head_dim, ("embed", "heads"), dt, rngs)
        if sparse and not shared:
            self.indexer = LightningIndexer(cfg, dt, quant, rngs=rngs)

    def init_state(self, num_pages: int, page_size: int, dtype, batch_size: int) -> MLAState:
        cfg = self.cfg
        latent = Pool.empty(num_pages, page_size, cfg.kv_lora_rank, dtype, self.latent_fmt, self.tile)
        # the rope part stays unquantized; none at all without one (R = 0: GLM-5.3-Flash's NoPE DSA)
        rope = Pool.empty(num_pages, page_size, cfg.qk_rope_head_dim, dtype) if cfg.qk_rope_head_dim else None
        ik, tail = None, None
        if self.sparse and not self.shared:
            ik, tail = self.indexer.init_state(num_pages, page_size, batch_size, dtype)
        return MLAState(latent=latent, rope=rope, index_k=ik, index_tail=tail)

    def _rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        cfg = self.cfg
        if not cfg.mla_use_rope or cfg.qk_rope_head_dim == 0:
            return x
        inv = inv_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
        return apply_rope(
            x, positions, inv, interleaved=cfg.mla_rope_interleave, factor=attention_factor(cfg.rope_scaling)
        )

    def _dense_probs(self, q_lat, q_pe, pages, info: StepInfo) -> jax.Array:
        """Causal softmax of the absorbed-form logits over every cached position: [B, N, T, S] float32."""
        lat = self.cfg.kv_lora_rank
        ctx = _visible(gather_pages(pages, info.page_table), info.kv_lengths).astype(jnp.float32)
        logits = jnp.einsum("btnl,bsl->bnts", q_lat, ctx[..., :lat], precision=HIGHEST)
        logits = (
            logits + jnp.einsum("btnr,bsr->bnts", q_pe, ctx[..., lat:], precision=HIGHEST)
        ) * self.cfg.softmax_scale
        causal = jnp.arange(ctx.shape[1])[None, None, None, :] <= info.positions[:, None, :, None]
        return jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1)

    def _blocked_prefill(self, q_nope, q_pe, pools: tuple[Pool, ...], info: StepInfo) -> jax.Array:
        """Dense (naive-form) attention of this call's queries over every cached key, PREFILL_KEY_BLOCK keys
        at a time: each block's pages gathered and dequantized, its latents expanded to keys and values, the
        flash kernel's (out, LSE) merged across blocks; blocks past the longest row's keys are not visited.
        -> o [B, T, N, V] in the compute dtype."""
        cfg = self.cfg
        b, t, n = q_nope.shape[:3]
        nope, vd, lat, r = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        g = pools[0].values.shape[1]
        per = max(1, PREFILL_KEY_BLOCK // g)  # pages per block
        span = per * g
        blocks = -(-info.page_table.shape[1] // per)
        # pages past the table repeat its first entry: their positions lie past every kv_length (masked)
        table = jnp.pad(info.page_table, [(0, 0), (0, blocks * per - info.page_table.shape[1])], mode="edge")
        q = jnp.concatenate([q_nope, q_pe], axis=-1)

        def block(i, carry):
            m, l, acc = carry  # running max LSE, Σ exp(lse - m), Σ exp(lse - m) o: [B,T,N] f32, [B,T,N,V] f32
            pages = jax.lax.dynamic_slice_in_dim(table, i * per, per, axis=1)
            ctx = jnp.concatenate([pool.gather(pages, self.dt.compute) for pool in pools], axis=-1)
            kvx = self.kv_b_proj(ctx[..., :lat]).reshape(b, span, n, nope + vd)
            k_rope = jnp.broadcast_to(ctx[:, :, None, lat:], (b, span, n, r)).astype(kvx.dtype)
            off = i * span
            o_b, lse_b = attention(
                q, jnp.concatenate([kvx[..., :nope], k_rope], axis=-1), kvx[..., nope:],
                q_positions=info.positions - off, kv_lengths=jnp.clip(info.kv_lengths - off, 0, span),
                scale=cfg.softmax_scale,
            )  # fmt: skip
            m_new = jnp.maximum(m, lse_b)
            safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            keep, w = jnp.exp(m - safe), jnp.exp(lse_b - safe)  # exp(-inf) = 0: nothing yet / nothing seen
            return m_new, l * keep + w, acc * keep[..., None] + w[..., None] * o_b.astype(jnp.float32)

        needed = -(-jnp.max(info.kv_lengths) // span)  # blocks holding any visible key
        init = (jnp.full((b, t, n), -jnp.inf), jnp.zeros((b, t, n)), jnp.zeros((b, t, n, vd)))
        _, l, acc = jax.lax.fori_loop(0, needed, block, init)
        return (acc / jnp.where(l > 0, l, 1.0)[..., None]).astype(self.dt.compute)

    def __call__(self, x: jax.Array, info: StepInfo, state: MLAState | None, selection: jax.Array | None = None):
        """-> (y [B,T,D], the new state, the Top-K positions a sparse layer read [B,T,K] or None). A layer that
        shares its indexer (`indexer_types`) reads `selection`, the Top-K of the full sparse layer right before."""
        cfg = self.cfg
        b, t, _ = x.shape
        n, nope, vd, lat = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        # the projections of x as one GEMV launch at a batch-1 decode step (`project_many`)
        firsts = [self.q_proj if cfg.q_lora_rank is None else self.q_a_proj, self.kv_a_proj_with_mqa]
        firsts += [self.output_gate_proj] if cfg.mla_output_gate else []
        q, kv, *gate_logits = project_many([(layer, x) for layer in firsts])
        if cfg.q_lora_rank is not None:
            c_q = self.q_a_layernorm(q)
            q = self.q_b_proj(c_q)
        else:
            c_q = x
        q = q.reshape(b, t, n, cfg.qk_head_dim)
        q_nope, q_pe = q[..., :nope], self._rope(q[..., nope:], info.positions)
        c = self.kv_a_layernorm(kv[..., :lat])
        k_pe = self._rope(kv[..., lat:], info.positions)
        latent = store_rows(None if state is None else state.latent, c, info, self.latent_fmt, self.tile)
        rope = None
        if cfg.qk_rope_head_dim:
            rope = store_rows(None if state is None else state.rope, k_pe, info, "dense", 0)
        pools = (latent,) if rope is None else (latent, rope)

        def pages():  # [P,G,L+R] dequantized; the sparse path reads the pools as stored instead
            return jnp.concatenate([pool.read(self.dt.compute) for pool in pools], axis=-1)

        def rows():  # [B,S,L+R]: each sequence's slots, gathered from each pool before they are joined, so
            # nothing copies a whole pool (the gathers take the dequantization along)
            return jnp.concatenate(
                [gather_pages(pool.read(self.dt.compute), info.page_table) for pool in pools], axis=-1
            )

        w_kv = dense_kernel(self.kv_b_proj, self.dt.compute).reshape(lat, n, nope + vd)
        w_uk, w_uv = w_kv[..., :nope], w_kv[..., nope:]  # [L,N,nope], [L,N,V]
        scale = cfg.softmax_scale
        index_pages, index_tail, idx = None, None, None
        if self.sparse:
            if self.shared:
                if selection is None:
                    raise ValueError("a shared sparse layer needs the selection of an earlier full sparse layer")
                idx = selection
                if inspect.recording():
                    inspect.add_record(indices=idx, positions=info.positions, shared=True)
            else:
                idx, index_pages, index_tail = self.indexer(
                    x, c_q, info, None if state is None else state.index_k, None if state is None else state.index_tail
                )
            q_lat = jnp.einsum("btnh,lnh->btnl", q_nope, w_uk, precision=HIGHEST)
            o_lat, _ = sparse_mla(
                q_lat, q_pe, latent.values, info.page_table, idx, scale=scale,
                rope_pages=None if rope is None else rope.values,
                latent_scales=latent.scales if self.latent_fmt == "fp8" else None,
            )  # fmt: skip
            if inspect.recording():  # what dense attention would weigh, to compare with the indexer's choice
                inspect.attach(attention=self._dense_probs(q_lat, q_pe, pages(), info))
            o = jnp.einsum("btnl,lnv->btnv", o_lat, w_uv, precision=HIGHEST)
        elif info.mode in ("decode", "verify"):  # a few queries against the cache: the absorbed form, read
            # from the pools in place (`mla_decode`: the context split over the GPU, no gathered copy)
            # its own kernel: at one row XLA otherwise fuses this product into its consumer as one serial
            # reduction per output (docs/performance.md#projections)
            (q_lat,) = own_kernels(jnp.einsum("btnh,lnh->btnl", q_nope, w_uk, precision=HIGHEST))
            # the pools as stored (the op converts the rows it reads; no per-step copy of a whole pool)
            o_lat, _ = mla_decode(
                q_lat, q_pe, latent.values, info.page_table, q_positions=info.positions,
                kv_lengths=info.kv_lengths, scale=scale, rope_pages=None if rope is None else rope.values,
                latent_scales=latent.scales if self.latent_fmt == "fp8" else None,
            )  # fmt: skip
            o = jnp.einsum("btnl,lnv->btnv", o_lat, w_uv, precision=HIGHEST)
        elif info.page_table.shape[1] * latent.values.shape[1] > PREFILL_KEY_BLOCK:
            o = self._blocked_prefill(q_nope, q_pe, pools, info)
        else:
            ctx = rows()  # [B,S,L+R]
            s = ctx.shape[1]
            kvx = self.kv_b_proj(ctx[..., :lat]).reshape(b, s, n, nope + vd)
            k_rope = jnp.broadcast_to(ctx[:, :, None, lat:], (b, s, n, cfg.qk_rope_head_dim))
            k = jnp.concatenate([kvx[..., :nope], k_rope.astype(kvx.dtype)], axis=-1)
            o, _ = attention(
                jnp.concatenate([q_nope, q_pe], axis=-1),
                k,
                kvx[..., nope:],
                q_positions=info.positions,
                kv_lengths=info.kv_lengths,
                scale=scale,
            )
        if cfg.mla_output_gate:
            gate = jax.nn.sigmoid(gate_logits[0].astype(jnp.float32)).reshape(b, t, n, vd)
            o = (o.astype(jnp.float32) * gate).astype(self.dt.compute)
        out = self.o_proj(o.reshape(b, t, n * vd).astype(self.dt.compute))
        new_state = None
        if state is not None:
            new_state = MLAState(latent=latent, rope=rope, index_k=index_pages, index_tail=index_tail)
        return out, new_state, idx
