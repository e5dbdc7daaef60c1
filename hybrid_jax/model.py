"""The hybrid decoder: embedding, heterogeneous decoder layers, final norm and LM head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybrid_jax.cache import (
    AttnState,
    HybridCache,
    KDAState,
    MLAState,
    PendingCache,
    StepInfo,
    is_concrete,
    make_page_table,
)
from hybrid_jax.config import HybridConfig
from hybrid_jax.layers.attention import GatedAttention
from hybrid_jax.layers.attn_res import AttnResMix
from hybrid_jax.layers.common import DTypes, RMSNorm, SwiGLU, linear
from hybrid_jax.layers.hyper import HyperConnection, collapse_streams, expand_streams
from hybrid_jax.layers.kda import KimiDeltaAttention
from hybrid_jax.layers.mla import MultiHeadLatentAttention
from hybrid_jax.layers.moe import MoE
from hybrid_jax.quant.config import QuantConfig
from sharding.rules import constrain

# The residual stream [B, T, D]: sequence-parallel inside the TP group (see sharding.rules) when a mesh is set.
RESIDUAL = ("batch", "act_seq", "embed")
STREAMS = ("batch", "act_seq", None, "embed")  # hyper-connection streams [B, T, N, D]


class Embed(nnx.Module):
    def __init__(self, vocab: int, dim: int, dt: DTypes, rngs: nnx.Rngs):
        self.dtype = dt.compute
        self.embedding = nnx.Param(
            nnx.initializers.normal(1.0)(rngs.params(), (vocab, dim), dt.param), logical_axes=("vocab", "embed")
        )

    def __call__(self, ids: jax.Array) -> jax.Array:
        # mode="fill": an out-of-range id becomes NaN (visible), never a silently clamped row.
        return jnp.take(self.embedding[...], ids, axis=0, mode="fill", fill_value=jnp.nan).astype(self.dtype)


class DecoderLayer(nnx.Module):
    """One mixer (KDA, MLA or gated GQA) + one FFN (SwiGLU or MoE), pre-norm.

    Plain residuals:  h ← h + Mixer(RMSNorm(h));  h ← h + FFN(RMSNorm(h)).
    Block AttnRes (the Kimi K3 reference's order; layer i, block size S layers, `blocks` = completed block
    sums, b_0 = embedding):
        r = h;  if blocks: h = AR_pre(blocks, h);  if i % S == 0: blocks += [r], r = 0
        h = r + Mixer(RMSNorm(h));  r = h;  h = AR_post(blocks, h);  h = r + FFN(RMSNorm(h))
    Hyper-connections (`hc_mult` streams h [B,T,N,D], layers/hyper.py):
        h ← HC_attn(h, Mixer ∘ RMSNorm);  h ← HC_ffn(h, FFN ∘ RMSNorm)
    A sparse layer that shares its indexer reads `selection`, the Top-K of the full sparse layer right before it.
    """

    def __init__(self, cfg: HybridConfig, index: int, dt: DTypes, quant: QuantConfig, *, rngs: nnx.Rngs):
        self.cfg, self.index = cfg, index
        self.layer_type = cfg.layer_types[index]
        d = cfg.hidden_size
        norm = dict(eps=cfg.rms_norm_eps, dt=dt, zero_centered=cfg.norm_zero_centered)
        self.input_layernorm = RMSNorm(d, **norm)
        self.post_attention_layernorm = RMSNorm(d, **norm)
        if self.layer_type == "linear":
            self.self_attn = KimiDeltaAttention(cfg, dt, rngs=rngs)
        elif self.layer_type == "attention":
            self.self_attn = GatedAttention(cfg, dt, quant, rngs=rngs)
        else:
            sparse, shared = self.layer_type == "sparse", cfg.shares_indexer(index)
            self.self_attn = MultiHeadLatentAttention(cfg, dt, quant, sparse=sparse, shared=shared, rngs=rngs)
        if cfg.mlp_types[index] == "moe":
            self.mlp = MoE(cfg, dt, rngs=rngs)
        else:
            self.mlp = SwiGLU(d, cfg.intermediate_size, dt, rngs, limit=cfg.swiglu_limit)
        if cfg.attn_res_block_size is not None:
            self.pre_attn_residual = AttnResMix(d, eps=cfg.rms_norm_eps, rngs=rngs)
            self.post_attn_residual = AttnResMix(d, eps=cfg.rms_norm_eps, rngs=rngs)
        if cfg.hc_mult is not None:
            hc = dict(iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps, rngs=rngs)
            self.attn_hc = HyperConnection(d, cfg.hc_mult, **hc)
            self.ffn_hc = HyperConnection(d, cfg.hc_mult, **hc)

    def _mix(self, x: jax.Array, info: StepInfo, state, selection):
        """The mixer -> (y, (new state, the selection later shared layers read))."""
        if self.layer_type in ("linear", "attention"):
            y, state = self.self_attn(x, info, state)
            return y, (state, selection)
        y, state, idx = self.self_attn(x, info, state, selection)
        return y, (state, idx if self.layer_type == "sparse" else selection)

    def __call__(self, h: jax.Array, blocks: list[jax.Array], info: StepInfo, state, selection=None):
        """-> (h, blocks, the layer's new cache state, the selection shared sparse layers read)."""
        if self.cfg.hc_mult is not None:
            h, (state, selection) = self.attn_hc(
                h, lambda u: self._mix(self.input_layernorm(u), info, state, selection)
            )
            h, _ = self.ffn_hc(h, lambda u: (self.mlp(self.post_attention_layernorm(u)), None))
            return h, blocks, state, selection
        bs = self.cfg.attn_res_block_size
        if bs is None:
            a, (state, selection) = self._mix(self.input_layernorm(h), info, state, selection)
            h, x = self.post_attention_layernorm.add(h, a)  # h + a and its norm (one kernel where switched on)
            return h + self.mlp(x), blocks, state, selection
        residual = h
        if blocks:
            h = self.pre_attn_residual(blocks, h)
        if self.index % bs == 0:
            blocks = [*blocks, residual.astype(jnp.float32)]
            residual = None
        a, (state, selection) = self._mix(self.input_layernorm(h), info, state, selection)
        h = a if residual is None else a + residual
        residual = h
        h = self.post_attn_residual(blocks, h)
        return residual + self.mlp(self.post_attention_layernorm(h)), blocks, state, selection


class SharedHead(nnx.Module):
    """An MTP module's output: logits = head(norm(g)) (DeepSeek's `shared_head`)."""

    def __init__(self, cfg: HybridConfig, dt: DTypes, rngs: nnx.Rngs):
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dt=dt, zero_centered=cfg.norm_zero_centered)
        self.head = linear(cfg.hidden_size, cfg.vocab_size, ("embed", "vocab"), dt, rngs)


class MTPLayer(DecoderLayer):
    """One multi-token-prediction module (DeepSeek-V3 §2.2; `model.layers.{num_layers + j}.*` in a checkpoint).

    Row p reads the target's final hidden state h_p (after the final norm, as vLLM and SGLang feed it) and the
    token t_{p+1}, at position p, and scores t_{p+2}:

        x_p = eh_proj([enorm(e_p); hnorm(h_p)]),   e_p = embed(t_{p+1}), zero at p = 0 (as vLLM masks it)
        g_p = DecoderLayer(x_p)                    (its own cache, causal over rows 0..p)
        logits_p = shared_head.head(shared_head.norm(g_p))

    Drafting k tokens reuses the module on its own output: row p + 1 reads (g_p, its draft)."""

    def __init__(self, cfg: HybridConfig, dt: DTypes, quant: QuantConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg.mtp_config(), 0, dt, quant, rngs=rngs)
        d = cfg.hidden_size
        norm = dict(eps=cfg.rms_norm_eps, dt=dt, zero_centered=cfg.norm_zero_centered)
        self.embed_tokens = Embed(cfg.vocab_size, d, dt, rngs)
        self.enorm = RMSNorm(d, **norm)
        self.hnorm = RMSNorm(d, **norm)
        self.eh_proj = linear(2 * d, d, (None, "embed"), dt, rngs)
        self.shared_head = SharedHead(cfg, dt, rngs)

    def step(self, ids: jax.Array, hidden: jax.Array, info: StepInfo, state, last_index=None):
        """ids [B, T] (t_{p+1}), hidden [B, T, D] (h_p) -> (float32 logits [B, T, V] or [B, V] at `last_index`,
        g [B, T, D] or [B, D], the new cache state)."""
        e = self.embed_tokens(ids)
        e = jnp.where((info.positions == 0)[..., None], jnp.zeros_like(e), e)
        x = jnp.concatenate([self.enorm(e), self.hnorm(hidden.astype(e.dtype))], axis=-1)
        x = constrain(self.eh_proj(x), RESIDUAL)
        g, _, state, _ = DecoderLayer.__call__(self, x, [], info, state, None)
        g = constrain(g, RESIDUAL)
        if last_index is not None:
            g = jnp.take_along_axis(g, last_index[:, None, None], axis=1)[:, 0]
        return self.shared_head.head(self.shared_head.norm(g)).astype(jnp.float32), g, state


class HybridLM(nnx.Module):
    """Causal LM over a hybrid stack of KDA / Gated DeltaNet, dense MLA, indexer-sparse MLA and gated GQA layers.

    `model(ids)` is the full forward without a cache. Incremental inference: `cache = model.init_cache(B, L)`,
    then `logits, cache = model.prefill(ids, cache, lengths)` (any number of calls, each appending tokens)
    and `logits, cache = model.decode_step(ids, cache)` (one token per sequence). All three are pure
    functions of their inputs and can be jitted.
    """

    def __init__(
        self,
        config: HybridConfig,
        *,
        dtype=jnp.float32,
        param_dtype=None,
        quant: QuantConfig | None = None,
        rngs: nnx.Rngs,
    ):
        self.config = config
        self.quant = quant = quant or QuantConfig()
        proj = quant.projection.param_dtype
        if param_dtype is not None and proj is not None and jnp.dtype(param_dtype) != jnp.dtype(proj):
            raise ValueError(
                f"param_dtype={jnp.dtype(param_dtype).name} contradicts "
                f"quant.projection.dtype={quant.projection.dtype!r}"
            )
        param_dtype = param_dtype or proj or jnp.float32
        if quant.indexer.enabled and "sparse" in config.layer_types and config.index_head_dim % 32:
            raise ValueError(f"MXFP8 indexer needs index_head_dim={config.index_head_dim} to be a multiple of 32")
        tile = quant.kv_cache.tile_size
        has_mla = any(t in ("full", "sparse") for t in config.layer_types)
        if quant.kv_cache.enabled and has_mla and config.kv_lora_rank % tile:
            raise ValueError(f"FP8 KV cache tile_size={tile} must divide kv_lora_rank={config.kv_lora_rank}")
        if quant.kv_cache.enabled and "attention" in config.layer_types and config.attn_head_dim % tile:
            raise ValueError(f"FP8 KV cache tile_size={tile} must divide attn_head_dim={config.attn_head_dim}")
        dt = DTypes(compute=jnp.dtype(dtype), param=jnp.dtype(param_dtype), fp8_weights=quant.projection.fp8_weights)
        self.dtypes = dt
        d = config.hidden_size
        self.embed_tokens = Embed(config.vocab_size, d, dt, rngs)
        self.layers = nnx.List([DecoderLayer(config, i, dt, quant, rngs=rngs) for i in range(config.num_layers)])
        self.norm = RMSNorm(d, eps=config.rms_norm_eps, dt=dt, zero_centered=config.norm_zero_centered)
        if config.attn_res_block_size is not None:
            self.final_attn_residual = AttnResMix(d, eps=config.rms_norm_eps, rngs=rngs)
        if not config.tie_word_embeddings:
            self.lm_head = linear(d, config.vocab_size, ("embed", "vocab"), dt, rngs)
        if config.mtp_layers:
            self.mtp = nnx.List([MTPLayer(config, dt, quant, rngs=rngs) for _ in range(config.mtp_layers)])

    # ------------------------------------------------------------------ core
    def _logits(self, h: jax.Array) -> jax.Array:
        if self.config.tie_word_embeddings:
            w = self.embed_tokens.embedding[...].astype(h.dtype)
            return jnp.einsum("...d,vd->...v", h, w, preferred_element_type=jnp.float32)
        return self.lm_head(h).astype(jnp.float32)

    def forward(
        self, input_ids: jax.Array, info: StepInfo, states=None, last_index: jax.Array | None = None, *,
        return_hidden: bool = False,
    ):  # fmt: skip
        """The decoder over one step's `StepInfo` (positions, validity, cache addresses, CP layout): ids [B, T],
        per-layer cache states (None: no cache) -> (float32 logits [B, T, vocab], or [B, vocab] at
        `last_index` [B]; the new states[; with return_hidden the final normed hidden states [B, T, D], what the
        MTP drafter reads]). What `__call__`, `prefill`, `decode_step` and the context-parallel prefill
        (`sharding.context_parallel`) share; most callers want those instead."""
        cfg = self.config
        h = constrain(self.embed_tokens(input_ids), RESIDUAL)
        if cfg.hc_mult is not None:
            h = constrain(expand_streams(h, cfg.hc_mult), STREAMS)
        blocks: list[jax.Array] = []
        new_states = []
        selection = None  # the latest sparse layer's Top-K, for a shared layer right after it
        for i, layer in enumerate(self.layers):
            h, blocks, st, selection = layer(h, blocks, info, None if states is None else states[i], selection)
            h = constrain(h, RESIDUAL if cfg.hc_mult is None else STREAMS)
            new_states.append(st)
        if cfg.attn_res_block_size is not None:
            h = self.final_attn_residual(blocks, h)
        if cfg.hc_mult is not None:
            h = collapse_streams(h)
        if return_hidden:
            hidden = self.norm(h)
            last = hidden
            if last_index is not None:
                last = jnp.take_along_axis(hidden, last_index[:, None, None], axis=1)[:, 0]
            return self._logits(last), tuple(new_states), hidden
        if last_index is not None:  # only the logits that sampling needs: [B, D] instead of [B, T, D]
            h = jnp.take_along_axis(h, last_index[:, None, None], axis=1)[:, 0]
        return self._logits(self.norm(h)), tuple(new_states)

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        """Full causal forward without a cache: ids [B, T] -> float32 logits [B, T, vocab]."""
        self._check_ids(input_ids)
        b, t = input_ids.shape
        logits, _ = self.forward(input_ids, StepInfo.uncached(b, t))
        return logits

    # ------------------------------------------------------------------ cache
    def init_cache(
        self,
        batch_size: int,
        max_len: int,
        *,
        dtype=None,
        page_size: int | None = None,
        num_pages: int | None = None,
        page_table=None,
    ) -> HybridCache:
        """Empty caches for `batch_size` sequences of up to `max_len` tokens (prompt + generated).

        Paged layers share one page table: by default sequence b owns a contiguous run of pages; pass
        `page_table` [B, ceil(max_len / page_size)] and `num_pages` for any other placement in the pool."""
        cfg = self.config
        if batch_size <= 0:
            raise ValueError(f"init_cache: batch_size={batch_size} must be positive")
        if not 0 < max_len <= cfg.max_position_embeddings:
            raise ValueError(
                f"init_cache: max_len={max_len} must be in [1, max_position_embeddings={cfg.max_position_embeddings}]"
            )
        g = page_size or cfg.page_size
        kpool = cfg.index_kpool if "sparse" in cfg.layer_types else 1
        if g % kpool:
            raise ValueError(f"init_cache: page_size={g} must be a multiple of index_kpool={kpool}")
        table = make_page_table(batch_size, max_len, g, num_pages=num_pages, page_table=page_table)
        pool = num_pages if num_pages is not None else table.shape[0] * table.shape[1]
        dtype = dtype or self.dtypes.compute
        states = tuple(
            layer.self_attn.init_state(batch_size, dtype)
            if layer.layer_type == "linear"
            else layer.self_attn.init_state(pool, g, dtype, batch_size)
            for layer in self.layers
        )
        return HybridCache(
            layers=states, page_table=table, lengths=jnp.zeros((batch_size,), jnp.int32), max_len=max_len, page_size=g
        )

    def _check_ids(self, ids, lengths=None) -> None:
        """Shape and vocabulary checks, eager when the values are concrete; padding (t >= lengths) is skipped."""
        ids_shape = np.shape(ids)
        if len(ids_shape) != 2 or ids_shape[1] == 0:
            raise ValueError(f"input_ids must be [batch, time] with time >= 1, got shape {ids_shape}")
        if is_concrete(ids, lengths):
            arr = np.asarray(ids)
            if lengths is not None:
                arr = arr[np.arange(ids_shape[1])[None, :] < np.asarray(lengths).reshape(-1, 1)]
            bad = arr[(arr < 0) | (arr >= self.config.vocab_size)]
            if bad.size:
                raise ValueError(f"token id {int(bad[0])} is outside the vocabulary [0, {self.config.vocab_size})")

    def _step_info(self, cache: HybridCache, b: int, t: int, n_new, mode: str, snapshot_every=None):
        """The StepInfo of appending up to t tokens per row to `cache` (checks eager where concrete) ->
        (info, overflow [B]): a row that would overflow under jit takes none of its tokens."""
        if b != cache.batch_size:
            raise ValueError(f"input batch {b} != cache batch {cache.batch_size}")
        n_new = jnp.asarray(n_new, jnp.int32)
        if n_new.shape != (b,):
            raise ValueError(f"lengths shape {n_new.shape} != ({b},)")
        if is_concrete(n_new, cache.lengths):
            nn_, cl = np.asarray(n_new), np.asarray(cache.lengths)
            if (nn_ < 0).any() or (nn_ > t).any():
                raise ValueError(f"lengths {nn_.tolist()} must lie in [0, {t}]")
            over = np.nonzero(cl + nn_ > cache.max_len)[0]
            if over.size:
                i = int(over[0])
                raise ValueError(
                    f"sequence {i}: {int(cl[i])} cached + {int(nn_[i])} new tokens exceed the cache "
                    f"capacity max_len={cache.max_len}"
                )
        steps = jnp.arange(t, dtype=jnp.int32)
        positions = cache.lengths[:, None] + steps[None, :]
        # Under jit the capacity check above cannot raise: a row that would overflow takes none of its tokens
        # (its cache, state and length stay as they were; nothing is clamped) and gets NaN logits.
        overflow = cache.lengths + n_new > cache.max_len
        n_new = jnp.where(overflow, 0, n_new)
        valid = steps[None, :] < n_new[:, None]
        info = StepInfo(
            positions=positions, valid=valid, n_new=n_new, page_table=cache.page_table,
            kv_lengths=cache.lengths + n_new, mode=mode, snapshot_every=snapshot_every,
        )  # fmt: skip
        return info, overflow

    @staticmethod
    def _advance(cache: HybridCache, info: StepInfo, states, logits, overflow):
        logits = jnp.where(overflow.reshape((-1,) + (1,) * (logits.ndim - 1)), jnp.nan, logits)
        return logits, cache.replace(layers=states, lengths=info.kv_lengths)

    def _extend(self, input_ids, cache: HybridCache, n_new, mode: str, last_only: bool, return_hidden=False,
                snapshot_every=None):  # fmt: skip
        b, t = input_ids.shape
        info, overflow = self._step_info(cache, b, t, n_new, mode, snapshot_every)
        last = jnp.maximum(info.n_new - 1, 0) if last_only else None
        out = self.forward(input_ids, info, cache.layers, last, return_hidden=return_hidden)
        states, snaps = out[1], None
        if snapshot_every is not None:
            states, snaps = _split_snapshots(states)
        logits, new_cache = self._advance(cache, info, states, out[0], overflow)
        extra = ((out[2],) if return_hidden else ()) + ((snaps,) if snapshot_every is not None else ())
        return (logits, new_cache, *extra)

    # ------------------------------------------------------------------ multi-token prediction
    def init_mtp_cache(self, batch_size: int, max_len: int, *, dtype=None) -> HybridCache:
        """Empty caches of the MTP modules (one layer each), positions as the target's."""
        if not self.config.mtp_layers:
            raise ValueError("init_mtp_cache: this model has no multi-token-prediction layer (mtp_layers=0)")
        g = self.config.page_size
        table = make_page_table(batch_size, max_len, g)
        pool = table.shape[0] * table.shape[1]
        dtype = dtype or self.dtypes.compute
        states = tuple(m.self_attn.init_state(pool, g, dtype, batch_size) for m in self.mtp)
        return HybridCache(
            layers=states, page_table=table, lengths=jnp.zeros((batch_size,), jnp.int32), max_len=max_len, page_size=g
        )

    def mtp_extend(self, ids, hidden, cache: HybridCache, n_new, *, mode: str = "prefill", last_only: bool = False,
                   module: int = 0):  # fmt: skip
        """Append rows to MTP module `module`'s cache: ids [B, T] the tokens t_{p+1}, hidden [B, T, D] the hidden
        states h_p (the target's, `forward(return_hidden=True)`, or the module's own g when drafting), n_new [B]
        real rows -> (logits [B, T, V] or [B, V] at each row's last one, g likewise, the cache). Row positions
        continue the cache's length. `mode` as for the target ("verify" reads the cache in the decode form)."""
        b, t = ids.shape
        info, overflow = self._step_info(cache, b, t, n_new, mode)
        last = jnp.maximum(info.n_new - 1, 0) if last_only else None
        layer = cache.layers[module]
        logits, g, state = self.mtp[module].step(ids, hidden, info, layer, last)
        layers = cache.layers[:module] + (state,) + cache.layers[module + 1 :]
        logits, new_cache = self._advance(cache, info, layers, logits, overflow)
        return logits, g, new_cache

    def prefill(
        self, input_ids: jax.Array, cache: HybridCache, lengths=None, *, last_only: bool = False,
        return_hidden: bool = False, snapshot_every: int | None = None,
    ):  # fmt: skip
        """Append tokens to every sequence: ids [B, T] (right-padded), lengths [B] real tokens per row
        (default T). Returns (logits [B, T, vocab] float32 — or [B, vocab] at each row's last real token
        when last_only — and the updated cache[, with return_hidden the final normed hidden states [B, T, D]]
        [, with snapshot_every the snapshots]). Padded positions change no state.

        snapshot_every=E (a positive int, static): also every per-sequence state after E, 2E, ..., S·E tokens
        of this call (S = T // E), last: a tuple with one entry per layer — KDAState(conv [B, S, W-1, 3C],
        recurrent [B, S, N, K, V]) for a KDA layer, the KPool tail [B, S, P, 2 H_I] (or None) for an MLA layer,
        None for a GQA layer: what a prefix cache keeps at its block boundaries (`hybrid_jax.PrefixCache`),
        from the one call instead of a call per block. KDA's come from its state pass (`kda(state_every=E)`).
        A row's snapshots past its real tokens are not meaningful."""
        self._check_ids(input_ids, lengths)
        b, t = input_ids.shape
        if snapshot_every is not None and (
            not isinstance(snapshot_every, (int, np.integer)) or isinstance(snapshot_every, bool) or snapshot_every < 1
        ):
            raise ValueError(f"snapshot_every={snapshot_every!r} must be a positive int (static under jit)")
        n_new = jnp.full((b,), t, jnp.int32) if lengths is None else lengths
        snap = None if snapshot_every is None else int(snapshot_every)
        return self._extend(input_ids, cache, n_new, "prefill", last_only, return_hidden, snap)

    def decode_step(self, token_ids: jax.Array, cache: HybridCache, active=None):
        """One token per sequence: ids [B] -> (logits [B, vocab] float32, cache). Rows with active=False
        are left unchanged (their logits are meaningless)."""
        token_ids = jnp.asarray(token_ids)
        if token_ids.ndim != 1:
            raise ValueError(f"decode_step takes token ids of shape [batch], got {token_ids.shape}")
        self._check_ids(token_ids[:, None], active)
        b = token_ids.shape[0]
        n_new = jnp.ones((b,), jnp.int32) if active is None else jnp.asarray(active).astype(jnp.int32)
        logits, cache = self._extend(token_ids[:, None], cache, n_new, "decode", False)
        return logits[:, 0], cache

    def verify(self, input_ids: jax.Array, cache: HybridCache, lengths=None, *, return_hidden: bool = False):
        """Score a block of tokens per sequence and keep what a rollback needs (speculative decoding): ids [B, T]
        (right-padded), lengths [B] real tokens per row (default T) -> (logits [B, T, vocab] float32, a
        `PendingCache`). Attention layers read the cache in the absorbed (decode) form and write all T tokens;
        KDA layers run the decode step token by token and keep the state after each. Pass the result to
        `commit` with the number of tokens each row keeps. return_hidden: also the final normed hidden states
        [B, T, D] (third), what the MTP drafter reads."""
        self._check_ids(input_ids, lengths)
        b, t = input_ids.shape
        n_new = jnp.full((b,), t, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
        out = self._extend(input_ids, cache, n_new, "verify", False, return_hidden)
        pending = PendingCache(cache=out[1], n_new=out[1].lengths - cache.lengths, block=t)
        return (out[0], pending, out[2]) if return_hidden else (out[0], pending)

    def commit(self, pending: PendingCache, keep) -> HybridCache:
        """The cache as if each row had been fed only the first keep[b] tokens of the verified block (keep [B] in
        [0, n_new]): per-sequence states take their snapshot after keep tokens, pool rows past it are cleared,
        lengths advance by keep. Nothing is recomputed. Under jit a keep outside [0, n_new] cannot raise: that row's
        pools are left as they are, its states come back NaN and its length past max_len, so every later call
        gives the row NaN logits (as an overflowing row does) — never a silently chosen snapshot."""
        cache, n_new = pending.cache, pending.n_new
        keep = jnp.asarray(keep, jnp.int32)
        if keep.shape != n_new.shape:
            raise ValueError(f"commit: keep shape {keep.shape} != ({n_new.shape[0]},)")
        if is_concrete(keep, n_new):
            k, n = np.asarray(keep), np.asarray(n_new)
            bad = np.nonzero((k < 0) | (k > n))[0]
            if bad.size:
                i = int(bad[0])
                raise ValueError(f"commit: keep[{i}]={int(k[i])} is outside [0, n_new={int(n[i])}]")
        start = cache.lengths - n_new  # the length before the verify step
        bad_row = (keep < 0) | (keep > n_new)
        new_len = jnp.where(bad_row, cache.lengths, start + keep)  # where the clearing starts (none: bad rows)

        def pick(x):  # snapshots [B, T+1, ...] -> the one after keep tokens [B, ...]
            idx = jnp.where(bad_row, x.shape[1], keep).reshape((-1,) + (1,) * (x.ndim - 1))
            return jnp.take_along_axis(x, idx, axis=1, mode="fill", fill_value=jnp.nan)[:, 0]

        t, page_table = pending.block, cache.page_table
        layers = []
        for st in cache.layers:
            if isinstance(st, KDAState):
                st = KDAState(conv=pick(st.conv), recurrent=pick(st.recurrent))
            elif isinstance(st, AttnState):
                st = AttnState(*(p.clear(page_table, new_len, cache.lengths, t) for p in (st.k, st.v)))
            elif isinstance(st, MLAState):
                latent = st.latent.clear(page_table, new_len, cache.lengths, t)
                rope = None if st.rope is None else st.rope.clear(page_table, new_len, cache.lengths, t)
                index_k, tail = st.index_k, st.index_tail
                if tail is not None:  # KPool: one key per complete pool; pools no longer complete are cleared
                    p = self.config.index_kpool
                    index_k = index_k.clear(page_table, new_len // p, cache.lengths // p, t // p + 1)
                    tail = pick(tail)
                elif index_k is not None:
                    index_k = index_k.clear(page_table, new_len, cache.lengths, t)
                st = MLAState(latent=latent, rope=rope, index_k=index_k, index_tail=tail)
            layers.append(st)
        return cache.replace(layers=tuple(layers), lengths=jnp.where(bad_row, cache.max_len + 1, new_len))


def _split_snapshots(states):
    """Layer states of a prefill with snapshots (per-sequence leaves [B, S+1, ...], the last entry the state
    after the call) -> (the states to continue from, the snapshots [B, S, ...] per layer)."""
    new, snaps = [], []
    for st in states:
        if isinstance(st, KDAState):
            new.append(KDAState(conv=st.conv[:, -1], recurrent=st.recurrent[:, -1]))
            snaps.append(KDAState(conv=st.conv[:, :-1], recurrent=st.recurrent[:, :-1]))
        elif isinstance(st, MLAState) and st.index_tail is not None:
            new.append(st.replace(index_tail=st.index_tail[:, -1]))
            snaps.append(st.index_tail[:, :-1])
        else:
            new.append(st)
            snaps.append(None)
    return tuple(new), tuple(snaps)
