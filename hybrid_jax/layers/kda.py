"""Kimi Delta Attention layer (docs/architecture.md §2); Gated DeltaNet when `kda_scalar_decay`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybrid_jax.cache import KDAState, StepInfo
from hybrid_jax.config import HybridConfig
from hybrid_jax.layers.common import DTypes, linear, project_many
from pallas_kernels.linear_attention import (
    decode_layer_uses_kernel,
    gated_rms_norm,
    gather_in_sequence_order,
    kda,
    kda_decode_layer,
    kda_decode_step,
    kda_decode_steps,
    kda_gate,
    kda_sequence_parallel,
    kda_verify_layer,
    short_conv,
    split_pieces,
)
from pallas_kernels.projection import SplitK, materialize
from sharding.rules import constrain


def _placed(state: KDAState) -> KDAState:
    """Batch over the data axis, heads over the tensor axis (the conv tail's channels are q|k|v heads). A
    verify step's snapshots (one more axis after the batch) are placed the same way."""
    snap = (None,) * (state.recurrent.ndim - 4)
    return KDAState(
        conv=constrain(state.conv, ("batch", *snap, None, "kda_heads")),
        recurrent=constrain(state.recurrent, ("batch", *snap, "kda_heads", None, None)),
    )


class ShortConv(nnx.Module):
    """Depthwise causal conv, `kernel` [W, C]; tap W-1 multiplies the current token (torch weight[c, 0, j])."""

    def __init__(self, channels: int, width: int, dt: DTypes, rngs: nnx.Rngs):
        bound = width**-0.5
        self.kernel = nnx.Param(
            jax.random.uniform(rngs.params(), (width, channels), dt.param, -bound, bound),
            logical_axes=(None, "kda_heads"),
        )


class GatedRMSNorm(nnx.Module):
    """y = γ ⊙ o / sqrt(mean(o²) + ε) ⊙ act(z) per head, in float32 with one final rounding (fla
    FusedRMSNormGated; transformers 5.23 Kimi-Linear with act = σ, Qwen3-Next with act = SiLU); γ is shared by
    all heads."""

    def __init__(self, dim: int, *, eps: float, dt: DTypes, gate: str = "sigmoid"):
        self.eps, self.dtype, self.gate = eps, dt.compute, gate
        self.weight = nnx.Param(jnp.ones((dim,), dt.param), logical_axes=("norm",))

    def __call__(self, o: jax.Array, z: jax.Array) -> jax.Array:
        return gated_rms_norm(o, z, self.weight[...], self.eps, self.dtype, self.gate)


class KimiDeltaAttention(nnx.Module):
    """Token mixer with a fixed-size state per head.

        q̂, k̂, v̂ = W_q x, W_k x, W_v x;  q, k, v = SiLU(causal_conv(q̂, k̂, v̂))   (per channel, width W)
        q, k ← q, k / sqrt(Σ q² + 1e-6) per head;  q ← q K^-1/2
        g = −exp(A_log) ⊙ softplus(W_fb W_fa x + dt_bias)   (or lb·σ(exp(A_log)(f + dt_bias)) with a lower bound)
        β = σ(W_b x)
        S_t = (I − β_t k_t k_tᵀ) Diag(exp g_t) S_{t−1} + β_t k_t v_tᵀ;   o_t = S_tᵀ q_t
        y = W_o [ γ ⊙ o / sqrt(mean(o²) + ε) ⊙ act(W_gb W_ga x) ]   (per head over V; act σ, or SiLU for Qwen)

    Gated DeltaNet (`kda_scalar_decay`): one decay per head, g = −exp(A_log) softplus(W_a x + dt_bias). Qwen's
    grouping: q and k have N_k = `kda_num_k_heads` heads of K, v has N value heads of V = `kda_v_head_dim`; value
    head n reads q / k head n // (N / N_k) (transformers' repeat_interleave), so the state is [N, K, V].
    Padded tokens (valid=False) get β = 0 and g = 0, which leaves the state untouched.
    """

    def __init__(self, cfg: HybridConfig, dt: DTypes, *, rngs: nnx.Rngs):
        self.cfg, self.dt = cfg, dt
        d, n, hd = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
        qk_dim, dim = cfg.kda_dim, cfg.kda_value_dim  # q / k width, v (and output gate) width
        self.q_proj = linear(d, qk_dim, ("embed", "kda_heads"), dt, rngs)
        self.k_proj = linear(d, qk_dim, ("embed", "kda_heads"), dt, rngs)
        self.v_proj = linear(d, dim, ("embed", "kda_heads"), dt, rngs)
        self.q_conv1d = ShortConv(qk_dim, cfg.kda_conv_size, dt, rngs)
        self.k_conv1d = ShortConv(qk_dim, cfg.kda_conv_size, dt, rngs)
        self.v_conv1d = ShortConv(dim, cfg.kda_conv_size, dt, rngs)
        gate_dim = n if cfg.kda_scalar_decay else n * hd
        if cfg.kda_decay_rank is None:
            self.f_proj = linear(d, gate_dim, ("embed", "kda_heads"), dt, rngs)
        else:
            self.f_a_proj = linear(d, cfg.kda_decay_rank, ("embed", None), dt, rngs)
            self.f_b_proj = linear(cfg.kda_decay_rank, gate_dim, (None, "kda_heads"), dt, rngs)
        # Float32 on purpose: the gate is computed in float32 in every reference implementation.
        self.A_log = nnx.Param(
            jnp.log(jax.random.uniform(rngs.params(), (n,), jnp.float32, 1.0, 16.0)), logical_axes=("kda_heads",)
        )
        self.dt_bias = nnx.Param(
            jax.random.uniform(rngs.params(), (gate_dim,), jnp.float32, -4.0, 0.0), logical_axes=("kda_heads",)
        )
        self.b_proj = linear(d, n, ("embed", "kda_heads"), dt, rngs)
        if cfg.kda_output_gate_rank is None:
            self.g_proj = linear(d, dim, ("embed", "kda_heads"), dt, rngs)
        else:
            self.g_a_proj = linear(d, cfg.kda_output_gate_rank, ("embed", None), dt, rngs)
            self.g_b_proj = linear(cfg.kda_output_gate_rank, dim, (None, "kda_heads"), dt, rngs)
        self.o_norm = GatedRMSNorm(cfg.kda_v_dim, eps=cfg.rms_norm_eps, dt=dt, gate=cfg.kda_norm_gate)
        self.o_proj = linear(dim, d, ("kda_heads", "embed"), dt, rngs)
        # how the fused decode-layer kernel reads the heads (Kimi's layout by default; Qwen's grouped one)
        self.layout = (("num_k_heads", cfg.kda_k_heads), ("v_head_dim", cfg.kda_v_dim), ("gate", cfg.kda_norm_gate))

    def init_state(self, batch_size: int, dtype) -> KDAState:
        cfg = self.cfg
        return _placed(
            KDAState(
                conv=jnp.zeros((batch_size, cfg.kda_conv_size - 1, cfg.kda_conv_dim), dtype),
                recurrent=jnp.zeros((batch_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_v_dim), jnp.float32),
            )
        )

    def _heads(self, q, k, v):
        """Convolved q, k [B,T,N_k·K], v [B,T,N·V] -> per value head: q, k [B,T,N,K] (head n reads q / k head
        n // (N / N_k)), v [B,T,N,V]."""
        cfg = self.cfg
        b, t = q.shape[:2]
        n, nk, hd = cfg.kda_num_heads, cfg.kda_k_heads, cfg.kda_head_dim
        q, k = (x.reshape(b, t, nk, hd) for x in (q, k))
        if nk != n:
            q, k = (jnp.repeat(x, n // nk, axis=2) for x in (q, k))
        return q, k, v.reshape(b, t, n, cfg.kda_v_dim)

    def _uses_fused_decode(self) -> bool:
        cfg = self.cfg
        return decode_layer_uses_kernel(cfg.kda_head_dim, cfg.kda_v_dim, cfg.kda_dim)

    def _short_conv(self, xhat: jax.Array, prev: jax.Array, n_new: jax.Array) -> tuple[jax.Array, jax.Array]:
        """xhat [B,T,3C] raw projections, prev [B,W-1,3C] -> (SiLU(conv) [B,T,3C], new conv state)."""
        kernel = jnp.concatenate([c[...] for c in self._conv_kernels()], axis=1).astype(jnp.float32)  # [W, 3C]
        return short_conv(xhat, prev, kernel, n_new, self.dt.compute)

    def _conv_kernels(self):
        return self.q_conv1d.kernel, self.k_conv1d.kernel, self.v_conv1d.kernel

    def _projections(self, x: jax.Array, lazy: bool = False):
        """x [B,T,D] -> (q̂, k̂, v̂ [B,T,C] raw, f [B,T,gate] decay projection, z [B,T,C] output-gate projection,
        b [B,T,N] β logits). At a batch-1 decode step on a GPU the six projections of x go to the GEMV kernel
        as one launch per output tile size, and the two low-rank second halves as one more (`project_many`),
        reading the first halves' partial sums. lazy: the kernel's outputs stay partial sums
        (`projection.SplitK`) for the fused decode-layer kernel to add."""
        cfg = self.cfg
        f_first = self.f_proj if cfg.kda_decay_rank is None else self.f_a_proj
        z_first = self.g_proj if cfg.kda_output_gate_rank is None else self.g_a_proj
        firsts = (self.q_proj, self.k_proj, self.v_proj, f_first, z_first, self.b_proj)
        q, k, v, f, z, b = project_many([(layer, x) for layer in firsts], own_xla=True, lazy=True)
        seconds = [(self.f_b_proj, f)] if cfg.kda_decay_rank is not None else []
        seconds += [(self.g_b_proj, z)] if cfg.kda_output_gate_rank is not None else []
        outs = iter(project_many(seconds, lazy=lazy))
        f = f if cfg.kda_decay_rank is None else next(outs)
        z = z if cfg.kda_output_gate_rank is None else next(outs)
        outs = (q, k, v, f, z, b)
        return outs if lazy else tuple(materialize(y) for y in outs)

    def _decay(self, f: jax.Array) -> jax.Array:
        """Log decay g from the decay projection f [B,T,gate], float32: [B,T,N,K] (per channel) or [B,T,N]."""
        cfg = self.cfg
        return kda_gate(
            f, self.A_log[...], self.dt_bias[...], num_heads=cfg.kda_num_heads, head_dim=cfg.kda_head_dim,
            scalar=cfg.kda_scalar_decay, lower_bound=cfg.kda_gate_lower_bound,
        )  # fmt: skip

    def _output(self, z: jax.Array, o: jax.Array) -> jax.Array:
        """Output gate z [B,T,N·V] + gated RMSNorm per head, then o_proj: o [B,T,N,V] -> [B,T,D]."""
        b, t, n, hd = o.shape
        return self.o_proj(self.o_norm(o, z.reshape(b, t, n, hd)).reshape(b, t, n * hd))

    def _context_parallel(self, x, xhat, f, z, b_logits, info: StepInfo, state: KDAState | None):
        """Prefill of a sequence split over info.cp.axis, every row taking all its tokens: each piece's short
        conv starts from the last W-1 raw inputs of the piece before it (a halo gathered over the axis; the
        cached conv tail for the first piece), and the recurrence runs state-parallel from the cached state
        (pallas_kernels.linear_attention.context_parallel). Tokens past the real ones (info.valid false: the
        padding to whole pieces) get β = 0 and g = 0, so they change no state. With a cache, every device returns
        the same new state: the last W-1 raw inputs of the real tokens and the final recurrent state."""
        cfg, cp = self.cfg, info.cp
        b, t, _ = x.shape
        w = cfg.kda_conv_size
        table = np.asarray(cp.table)
        pieces = split_pieces(xhat, cp.pieces)
        if pieces[0].shape[1] < w - 1:
            raise ValueError(
                f"context-parallel pieces of {pieces[0].shape[1]} tokens are shorter than the conv halo {w - 1}"
            )
        tails = gather_in_sequence_order(jnp.stack([p[:, p.shape[1] - (w - 1) :] for p in pieces]), cp.axis, table)
        first = jnp.zeros_like(tails[:1]) if state is None else state.conv[None].astype(tails.dtype)
        halos = jnp.concatenate([first, tails[:-1]])  # halo of piece p = tail of piece p - 1
        mine = jnp.asarray(table)[jax.lax.axis_index(cp.axis)]
        full = jnp.full((b,), pieces[0].shape[1], jnp.int32)
        qkv = jnp.concatenate([self._short_conv(p, halos[mine[i]], full)[0] for i, p in enumerate(pieces)], axis=1)
        c = cfg.kda_dim
        q, k, v = self._heads(qkv[..., :c], qkv[..., c : 2 * c], qkv[..., 2 * c :])
        valid = info.valid
        beta = jnp.where(valid[..., None], jax.nn.sigmoid(b_logits.astype(jnp.float32)), 0.0)
        g = self._decay(f)
        g = jnp.where(valid.reshape(valid.shape + (1,) * (g.ndim - 2)), g, 0.0)
        o, s_final = kda_sequence_parallel(
            q,
            k,
            v,
            g,
            beta,
            axis=cp.axis,
            table=table,
            initial_state=None if state is None else state.recurrent,
            chunk_size=cfg.kda_chunk_size,
        )
        if state is None:
            return self._output(z, o), None
        # The conv tail: the raw inputs at the last W-1 real positions, wherever they sit. Each device adds the
        # rows it holds (one-hot, so the sum is exact) and the psum over the axis gathers them.
        rel = info.positions - (info.kv_lengths - info.n_new)[:, None]  # position within this prefill [B, T]
        want = info.n_new[:, None] - (w - 1) + jnp.arange(w - 1)[None, :]  # [B, W-1]
        hit = (rel[:, :, None] == want[:, None, :]).astype(jnp.float32)  # [B, T, W-1]
        picked = jnp.einsum("btj,btc->bjc", hit, xhat.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
        tail = jax.lax.psum(picked, cp.axis)
        new_state = _placed(KDAState(conv=tail.astype(state.conv.dtype), recurrent=s_final))
        return self._output(z, o), new_state

    def _verify(self, q, k, v, g, beta, z, raw, state: KDAState):
        """A verify step over T tokens: the outputs, and as the new state the snapshots after 0 .. T tokens
        (conv [B,T+1,W-1,3C], recurrent [B,T+1,N,K,V]) from which `HybridLM.commit` keeps one per row. The
        recurrence runs token by token (`kda_decode_steps`: the unfused decode step's kernel, what decode runs
        where the fused decode-layer kernel does not apply; `_verify_fused` where it does); snapshot j's conv
        tail is the last W-1 raw inputs after j tokens, as `short_conv` would leave them."""
        w = self.cfg.kda_conv_size
        o, states = kda_decode_steps(q, k, v, g, beta, state.recurrent, use_qk_l2norm=True, impl="auto")
        xhat = jnp.concatenate(raw, axis=-1)
        ext = jnp.concatenate([state.conv.astype(xhat.dtype), xhat], axis=1)  # [B, W-1+T, 3C]
        conv = jnp.stack([ext[:, j : j + w - 1] for j in range(q.shape[1] + 1)], axis=1).astype(state.conv.dtype)
        recurrent = jnp.concatenate([state.recurrent[:, None].astype(jnp.float32), states], axis=1)
        return self._output(z, o), _placed(KDAState(conv=conv, recurrent=recurrent))

    def _verify_fused(self, q_raw, k_raw, v_raw, f, z, b_logits, info: StepInfo, state: KDAState | None):
        """The verify step where decode runs the fused decode-layer kernel: the block in one launch
        (`kda_verify_layer`), each token's arithmetic the decode-layer kernel's (to float32 summation order),
        so the block computes what T decode steps would; the snapshots are the conv tail and state after each
        token, as `_verify` returns them. (As T decode-layer calls in a `lax.scan`, XLA copied the carried and
        stacked states at every token: docs/performance.md "Speculative decoding".)"""
        cfg = self.cfg
        b, t, _ = q_raw.shape
        n, hd = cfg.kda_num_heads, cfg.kda_head_dim
        state = self.init_state(b, q_raw.dtype) if state is None else state
        y, conv, recurrent = kda_verify_layer(
            q_raw, k_raw, v_raw, state.conv, [c[...] for c in self._conv_kernels()], f, self.A_log[...],
            self.dt_bias[...], b_logits, z, self.o_norm.weight[...], state.recurrent, info.valid, num_heads=n,
            head_dim=hd, scalar_decay=cfg.kda_scalar_decay, lower_bound=cfg.kda_gate_lower_bound,
            eps=self.o_norm.eps, **dict(self.layout),
        )  # fmt: skip
        y = y.reshape(b, t, n * cfg.kda_v_dim)
        return self.o_proj(y), _placed(KDAState(conv=conv, recurrent=recurrent))

    def __call__(self, x: jax.Array, info: StepInfo, state: KDAState | None):
        cfg = self.cfg
        b, t, _ = x.shape
        n, hd = cfg.kda_num_heads, cfg.kda_head_dim
        if info.mode == "decode" and info.cp is None and self._uses_fused_decode():
            # conv, gates, state update and gated norm as one kernel (pallas_kernels/linear_attention), which
            # adds the GEMV kernel's partial sums itself at batch 1
            q_raw, k_raw, v_raw, f, z, b_logits = (
                y if isinstance(y, SplitK) else y[:, 0] for y in self._projections(x, lazy=True)
            )
            state = self.init_state(b, x.dtype) if state is None else state
            y, conv, s = kda_decode_layer(
                q_raw, k_raw, v_raw, state.conv, [c[...] for c in self._conv_kernels()], f, self.A_log[...],
                self.dt_bias[...], b_logits, z, self.o_norm.weight[...], state.recurrent, info.valid[:, 0],
                info.n_new, num_heads=n, head_dim=hd, scalar_decay=cfg.kda_scalar_decay,
                lower_bound=cfg.kda_gate_lower_bound, eps=self.o_norm.eps, **dict(self.layout),
            )  # fmt: skip
            return self.o_proj(y.reshape(b, t, n * cfg.kda_v_dim)), _placed(KDAState(conv=conv, recurrent=s))
        q_raw, k_raw, v_raw, f, z, b_logits = self._projections(x)
        if info.mode == "verify" and self._uses_fused_decode():
            return self._verify_fused(q_raw, k_raw, v_raw, f, z, b_logits, info, state)
        if info.cp is not None:
            if info.snapshot_every is not None:
                raise ValueError("snapshot_every: state snapshots are not taken in a context-parallel prefill")
            xhat = jnp.concatenate([q_raw, k_raw, v_raw], axis=-1)  # XLA's q, k, v end their own fusions
            return self._context_parallel(x, xhat, f, z, b_logits, info, state)
        if state is None:
            state = self.init_state(b, x.dtype)
        # q, k and v convolved each on its own channels of the conv state ([q | k | v]): one [B,T,3C]
        # convolution split afterwards had XLA copy q, k and v once more
        c = cfg.kda_dim
        bounds = ((0, c), (c, 2 * c), (2 * c, cfg.kda_conv_dim))  # q | k | v channels of the conv state
        parts = [
            short_conv(raw, state.conv[..., lo:hi], kern[...].astype(jnp.float32), info.n_new, self.dt.compute)
            for (lo, hi), raw, kern in zip(bounds, (q_raw, k_raw, v_raw), self._conv_kernels(), strict=True)
        ]
        q, k, v = self._heads(*(y for y, _ in parts))
        conv = jnp.concatenate([tail for _, tail in parts], axis=-1)

        g = self._decay(f)
        beta = jax.nn.sigmoid(b_logits.astype(jnp.float32))  # [B,T,N]
        valid = info.valid
        beta = jnp.where(valid[..., None], beta, 0.0)
        g = jnp.where(valid.reshape(valid.shape + (1,) * (g.ndim - 2)), g, 0.0)

        if info.mode == "verify":  # every token's state kept: the rollback points of a speculative step
            return self._verify(q, k, v, g, beta, z, (q_raw, k_raw, v_raw), state)
        if info.mode == "decode":  # one token: the fused state read-modify-write (Pallas on GPU)
            o, s = kda_decode_step(
                q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state.recurrent, use_qk_l2norm=True, impl="auto"
            )
            o = o[:, None]
        else:
            out = kda(
                q, k, v, g, beta, initial_state=state.recurrent, use_qk_l2norm=True, impl="auto",
                chunk_size=cfg.kda_chunk_size, state_every=info.snapshot_every,
            )  # fmt: skip
            o, s = out[:2]
            if info.snapshot_every is not None:
                return self._output(z, o), self._with_snapshots(state, (q_raw, k_raw, v_raw), out[2], conv, s, info)

        return self._output(z, o), _placed(KDAState(conv=conv, recurrent=s))

    def _with_snapshots(self, state: KDAState, raw, states, conv, s, info: StepInfo) -> KDAState:
        """A prefill's new state with its snapshots (`HybridLM.prefill(snapshot_every=E)`): conv [B, S+1, W-1, 3C]
        and recurrent [B, S+1, N, K, V], entry j < S the state after (j + 1)·E tokens of the call (S = T // E;
        `kda(state_every=E)`), entry S the state after all of them. Snapshot j's conv tail is the W-1 raw inputs
        before token (j + 1)·E, as `short_conv` would leave them after that many tokens."""
        w, e = self.cfg.kda_conv_size, info.snapshot_every
        xhat = jnp.concatenate(raw, axis=-1)
        t = xhat.shape[1]
        # row r of [prev; xhat] (W-1+T rows) is prev[r] for r < W-1, else xhat[r - (W-1)]; rows [end, end + W-1)
        # are the tail after `end` tokens. Gathered from each part apart (as `short_conv` does), not from a
        # concatenation XLA would write out.
        r = ((jnp.arange(states.shape[1]) + 1) * e)[:, None] + jnp.arange(w - 1)[None, :]  # [S, W-1]
        from_prev = state.conv.astype(xhat.dtype)[:, jnp.minimum(r, w - 2)]
        from_new = xhat[:, jnp.clip(r - (w - 1), 0, t - 1)]
        tails = jnp.where((r < w - 1)[None, :, :, None], from_prev, from_new).astype(state.conv.dtype)
        return _placed(
            KDAState(
                conv=jnp.concatenate([tails, conv[:, None]], axis=1),
                recurrent=jnp.concatenate([states, s[:, None]], axis=1),
            )
        )
