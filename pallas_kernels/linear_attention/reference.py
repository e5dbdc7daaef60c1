"""Kimi Delta Attention (gated delta rule with channel-wise decay) in float32 jnp: the ground truth.

Per head, with state S in R^{K x V} (docs/architecture.md §2, step 8):
    S' = Diag(exp(g_t)) S_{t-1}
    S_t = S' + beta_t k_t (v_t - S'^T k_t)^T
    o_t = S_t^T q_t
Two forms: `kda_recurrent` (token by token, `lax.scan`) and `kda_chunked` (WY representation + UT
transform over chunks of C tokens, docs/architecture.md §3). Gated DeltaNet is the case g [B,T,N] (one
decay per head).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(sum x^2 + eps): eps inside the root, as FLA and HF do (not F.normalize)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _prepare(q, k, v, g, beta, initial_state, scale, use_qk_l2norm):
    b, t, n, dk = q.shape
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * (dk**-0.5 if scale is None else scale)
    g = g.astype(jnp.float32)
    if g.ndim == 3:  # scalar decay per head (Gated DeltaNet)
        g = jnp.broadcast_to(g[..., None], (b, t, n, dk))
    beta = beta.astype(jnp.float32)
    # zeros_like of an input-derived value: inside shard_map the scan carry then has the inputs' varying type.
    zero_state = jnp.zeros_like(k[:, 0, :, :, None] * v[:, 0, :, None, :])  # [B,N,K,V]
    s0 = zero_state if initial_state is None else initial_state.astype(jnp.float32)
    return q, k, v, g, beta, s0


def kda_recurrent(q, k, v, g, beta, *, initial_state=None, scale=None, use_qk_l2norm=True):
    """q, k [B,T,N,K]; v [B,T,N,V]; g [B,T,N,K] or [B,T,N] (log decay); beta [B,T,N];
    initial_state [B,N,K,V] -> (o [B,T,N,V] in q.dtype, final state [B,N,K,V] float32)."""
    out_dtype = q.dtype
    q, k, v, g, beta, s0 = _prepare(q, k, v, g, beta, initial_state, scale, use_qk_l2norm)

    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t = xs  # [B,N,K], [B,N,K], [B,N,V], [B,N,K], [B,N]
        s = s * jnp.exp(g_t)[..., None]
        ks = jnp.einsum("bnk,bnkv->bnv", k_t, s, precision=HIGHEST)
        s = s + (b_t[..., None, None] * k_t[..., None]) * (v_t - ks)[..., None, :]
        return s, jnp.einsum("bnk,bnkv->bnv", q_t, s, precision=HIGHEST)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    s, o = jax.lax.scan(step, s0, xs)
    return jnp.moveaxis(o, 0, 1).astype(out_dtype), s


def _decay_matrix(gc: jax.Array) -> jax.Array:
    """exp(G_i - G_j) for i >= j, else 0: [B,N,C,K] -> [B,N,C,C,K]. Masked before the exp, so no exp(+large)
    is ever formed (docs/architecture.md §3)."""
    i = jnp.arange(gc.shape[2])
    causal = i[:, None] >= i[None, :]
    return jnp.exp(jnp.where(causal[None, None, :, :, None], gc[:, :, :, None, :] - gc[:, :, None, :, :], -jnp.inf))


def _wy_factors(k, v, gc, beta, decay):
    """UT transform T = (I + A_kk)^-1 Diag(beta); W = T (exp(G) ⊙ K), U = T V; kg = K ⊙ exp(G_C - G)."""
    c = k.shape[2]
    i = jnp.arange(c)
    a_kk = jnp.einsum("bnik,bnjk,bnijk->bnij", k, k, decay, precision=HIGHEST)
    a_kk = jnp.where((i[:, None] > i[None, :])[None, None], a_kk * beta[..., None], 0.0)
    eye = jnp.eye(c, dtype=jnp.float32)
    t_mat = jax.lax.linalg.triangular_solve(
        eye + a_kk,
        jnp.broadcast_to(eye * beta[..., None, :], a_kk.shape),
        left_side=True,
        lower=True,
        unit_diagonal=True,
    )
    w = jnp.einsum("bnij,bnjk->bnik", t_mat, jnp.exp(gc) * k, precision=HIGHEST)
    u = jnp.einsum("bnij,bnjv->bniv", t_mat, v, precision=HIGHEST)
    g_last = gc[:, :, -1, :]  # [B,N,K]
    kg = k * jnp.exp(g_last[:, :, None, :] - gc)
    return w, u, kg, g_last


def _chunk_step(s0, xs):
    """One chunk of C tokens for all (batch, head) pairs; s0 [B,N,K,V] float32."""
    q, k, v, g, beta = xs  # [B,N,C,K] x3 (g), [B,N,C,V], [B,N,C]
    gc = jnp.cumsum(g, axis=2)  # G_r = sum_{i<=r} g_i, [B,N,C,K]
    decay = _decay_matrix(gc)
    w, u, kg, g_last = _wy_factors(k, v, gc, beta, decay)
    a_qk = jnp.einsum("bnik,bnjk,bnijk->bnij", q, k, decay, precision=HIGHEST)
    v_new = u - jnp.einsum("bnik,bnkv->bniv", w, s0, precision=HIGHEST)  # pseudo-values vs. the old state
    o = jnp.einsum("bnik,bnkv->bniv", jnp.exp(gc) * q, s0, precision=HIGHEST) + jnp.einsum(
        "bnij,bnjv->bniv", a_qk, v_new, precision=HIGHEST
    )
    s1 = jnp.exp(g_last)[..., None] * s0 + jnp.einsum("bnik,bniv->bnkv", kg, v_new, precision=HIGHEST)
    return s1, o


def _summary_step(carry, xs):
    """(M, E) <- (M_c M, M_c E + kg^T U) with the chunk transition M_c = Diag(exp(G_C)) - kg^T W
    (docs/architecture.md §4)."""
    m, e = carry
    k, v, g, beta = xs
    gc = jnp.cumsum(g, axis=2)
    w, u, kg, g_last = _wy_factors(k, v, gc, beta, _decay_matrix(gc))
    m_c = jnp.exp(g_last)[..., :, None] * jnp.eye(k.shape[-1]) - jnp.einsum(
        "bnik,bnij->bnkj", kg, w, precision=HIGHEST
    )  # [B,N,K,K]
    e = jnp.einsum("bnkj,bnjv->bnkv", m_c, e, precision=HIGHEST) + jnp.einsum(
        "bnik,bniv->bnkv", kg, u, precision=HIGHEST
    )
    return (jnp.einsum("bnkj,bnjl->bnkl", m_c, m, precision=HIGHEST), e), None


def _to_chunks(x, c: int):
    """[B,T,N,...] -> [T/C (padded), B, N, C, ...]; padding with zeros (g = 0, beta = 0 keep the state)."""
    b, t, n = x.shape[:3]
    nc = -(-t // c)
    x = jnp.pad(x, [(0, 0), (0, nc * c - t)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(b, nc, c, n, *x.shape[3:]), (1, 3), (0, 2))


def kda_state_summary(k, v, g, beta, *, use_qk_l2norm=True, chunk_size=64):
    """The affine map of a sequence shard: S_end = M S_start + E (docs/architecture.md §4).

    k [B,T,N,K], v [B,T,N,V], g [B,T,N,K] or [B,T,N], beta [B,T,N] -> (M [B,N,K,K], E [B,N,K,V]) float32.
    M depends only on k, g and beta; E is the shard's final state when started from zero."""
    _, k, v, g, beta, _ = _prepare(k, k, v, g, beta, None, None, use_qk_l2norm)
    dk = k.shape[-1]
    m0 = jnp.eye(dk, dtype=jnp.float32) + jnp.zeros_like(k[:, 0, :, :, None] * k[:, 0, :, None, :])  # [B,N,K,K]
    e0 = jnp.zeros_like(k[:, 0, :, :, None] * v[:, 0, :, None, :])  # [B,N,K,V]
    xs = tuple(_to_chunks(x, chunk_size) for x in (k, v, g, beta))
    (m, e), _ = jax.lax.scan(_summary_step, (m0, e0), xs)
    return m, e


def compose_summaries(first, second):
    """(M2, E2) after (M1, E1): (M2 M1, M2 E1 + E2). Associative, so prefix compositions can be scanned."""
    m1, e1 = first
    m2, e2 = second
    return (
        jnp.einsum("...kj,...jl->...kl", m2, m1, precision=HIGHEST),
        jnp.einsum("...kj,...jv->...kv", m2, e1, precision=HIGHEST) + e2,
    )


def apply_summary(summary, state):
    m, e = summary
    return jnp.einsum("...kj,...jv->...kv", m, state, precision=HIGHEST) + e


def kda_chunked(q, k, v, g, beta, *, initial_state=None, scale=None, use_qk_l2norm=True, chunk_size=64):
    """Same contract as `kda_recurrent`, computed chunk-wise (WY + UT transform)."""
    out_dtype = q.dtype
    q, k, v, g, beta, s0 = _prepare(q, k, v, g, beta, initial_state, scale, use_qk_l2norm)
    b, t, n, _ = q.shape
    xs = tuple(_to_chunks(x, chunk_size) for x in (q, k, v, g, beta))
    s, o = jax.lax.scan(_chunk_step, s0, xs)  # o [nc,B,N,C,V]
    o = jnp.moveaxis(o, (0, 2), (1, 3)).reshape(b, -1, n, o.shape[-1])[:, :t]
    return o.astype(out_dtype), s


# ---------------------------------------------------------------- a KDA layer's pieces around the recurrence
# (the model's KDA layer computes them with these functions; `kda_decode_layer_reference` composes them for a
# decode step, the ground truth of the fused decode-layer kernel)


def short_conv(xhat, prev, kernel, n_new, out_dtype):
    """Causal depthwise conv of width W + SiLU: xhat [B,T,C] raw projections, prev [B,W-1,C] the last W-1 raw
    inputs, kernel [W,C] float32, n_new [B] real tokens per row -> (SiLU(conv) [B,T,C] in out_dtype, the new
    prev: the W-1 raw inputs before each row's first padded token)."""
    w = kernel.shape[0]
    t = xhat.shape[1]
    state_dtype, prev = prev.dtype, prev.astype(xhat.dtype)
    # Row i of [prev; xhat] (W-1+T rows) is prev[i] for i < W-1, else xhat[i - (W-1)]. Each tap j selects between
    # two padded views instead of slicing one concatenation, which XLA wrote out whole per call; the terms and
    # their order are the same (j = 0 .. W-1).
    row = jnp.arange(t)[None, :, None]
    prev_ext = jnp.pad(prev, [(0, 0), (0, t), (0, 0)]).astype(jnp.float32)
    x_ext = jnp.pad(xhat, [(0, 0), (w - 1, 0), (0, 0)]).astype(jnp.float32)
    u = sum(kernel[j] * jnp.where(row + j < w - 1, prev_ext[:, j : j + t], x_ext[:, j : j + t]) for j in range(w))
    # row i of the new tail is row n_new + i of [prev; xhat], gathered from each part apart
    idx = n_new[:, None] + jnp.arange(w - 1)[None, :]  # [B, W-1]
    from_prev = jnp.take_along_axis(prev, jnp.minimum(idx, w - 2)[:, :, None], axis=1)
    from_new = jnp.take_along_axis(xhat, jnp.clip(idx - (w - 1), 0, t - 1)[:, :, None], axis=1)
    new_prev = jnp.where((idx < w - 1)[:, :, None], from_prev, from_new)
    return jax.nn.silu(u).astype(out_dtype), new_prev.astype(state_dtype)


def kda_gate(f, a_log, dt_bias, *, num_heads, head_dim, scalar, lower_bound=None):
    """Log decay g from the decay projection f [B,T,N*K] (per channel) or [B,T,N] (scalar), float32
    [B,T,N,K] or [B,T,N]: −exp(A_log) ⊙ softplus(f + dt_bias), or lb·σ(exp(A_log)(f + dt_bias))."""
    f = f.astype(jnp.float32) + dt_bias
    a = jnp.exp(a_log)  # [N]
    if not scalar:
        f = f.reshape(*f.shape[:-1], num_heads, head_dim)
        a = a[:, None]
    if lower_bound is not None:
        return lower_bound * jax.nn.sigmoid(a * f)
    softplus = jnp.where(f > 20.0, f, jnp.log1p(jnp.exp(jnp.minimum(f, 20.0))))
    return -a * softplus


def gated_rms_norm(o, z, weight, eps, out_dtype, gate: str = "sigmoid"):
    """γ ⊙ o / sqrt(mean(o²) + ε) ⊙ act(z) over the last axis, float32 with one final rounding; act is σ
    (`gate="sigmoid"`, Kimi's KDA) or SiLU (`"silu"`, Qwen's Gated DeltaNet)."""
    if gate not in ("sigmoid", "silu"):
        raise ValueError(f"gated_rms_norm: gate={gate!r} must be 'sigmoid' or 'silu'")
    o32, z32 = o.astype(jnp.float32), z.astype(jnp.float32)
    y = o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True) + eps)
    act = jax.nn.sigmoid(z32) if gate == "sigmoid" else jax.nn.silu(z32)
    return (y * weight.astype(jnp.float32) * act).astype(out_dtype)


def kda_decode_layer_reference(
    q_raw, k_raw, v_raw, conv_state, conv_weights, f, a_log, dt_bias, b_logits, z, norm_weight, state, valid,
    n_new, *, num_heads, head_dim, scalar_decay=False, lower_bound=None, eps=1e-6, step=None, num_k_heads=None,
    v_head_dim=None, gate="sigmoid",
):  # fmt: skip
    """One decode token of a KDA layer between its projections and o_proj: raw q, k [B, N_k*K], v, z [B, N*V]
    (compute dtype), conv_state [B, W-1, 2*N_k*K + N*V] (q | k | v channels), conv_weights (q, k, v) [W, ...]
    each, decay projection f [B, N*K] (or [B, N]), A_log [N], dt_bias, β logits [B, N], o_norm's γ [V], state
    [B, N, K, V] float32, valid [B] bool, n_new [B] -> (gated-normed o [B, N, V] in q_raw.dtype, new conv
    state, new state). N_k = num_k_heads (default N): value head n reads q / k head n // (N / N_k); V =
    v_head_dim (default K); gate: the output norm's σ or SiLU (`gated_rms_norm`).
    step(q, k, v, g, beta, state) -> (o, state) for one token [B, N, ...]: the recurrence (default
    `kda_recurrent`; the benchmarks pass the Pallas decode step to time the unfused layer)."""
    b = q_raw.shape[0]
    dt = q_raw.dtype
    nk, dv = num_k_heads or num_heads, v_head_dim or head_dim
    c = nk * head_dim
    xhat = jnp.concatenate([q_raw, k_raw, v_raw], axis=-1)[:, None]  # [B, 1, 2 N_k K + N V]
    kernel = jnp.concatenate(conv_weights, axis=1).astype(jnp.float32)
    qkv, conv = short_conv(xhat, conv_state, kernel, n_new, dt)
    q, k = (x.reshape(b, nk, head_dim) for x in (qkv[:, 0, :c], qkv[:, 0, c : 2 * c]))
    if nk != num_heads:
        q, k = (jnp.repeat(x, num_heads // nk, axis=1) for x in (q, k))
    v = qkv[:, 0, 2 * c :].reshape(b, num_heads, dv)
    g = kda_gate(f, a_log, dt_bias, num_heads=num_heads, head_dim=head_dim, scalar=scalar_decay,
                 lower_bound=lower_bound)  # fmt: skip
    g = jnp.where(valid.reshape((b,) + (1,) * (g.ndim - 1)), g, 0.0)
    beta = jnp.where(valid[:, None], jax.nn.sigmoid(b_logits.astype(jnp.float32)), 0.0)
    if step is None:
        o, s = kda_recurrent(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], initial_state=state)
        o = o[:, 0]
    else:
        o, s = step(q, k, v, g, beta, state)
    y = gated_rms_norm(o, z.reshape(b, num_heads, dv), norm_weight, eps, dt, gate)
    return y, conv, s


def kda_verify_layer_reference(
    q_raw, k_raw, v_raw, conv_state, conv_weights, f, a_log, dt_bias, b_logits, z, norm_weight, state, valid, **kw
):  # fmt: skip
    """A block of T tokens of a KDA layer, as T decode steps with every state kept (a speculative verify step):
    the per-token inputs of `kda_decode_layer_reference` with a token axis (q_raw [B, T, N_k*K], ..., b_logits
    [B, T, N], valid [B, T] bool: an invalid token leaves both states alone) and the same conv_state / state
    -> (y [B, T, N, V], conv snapshots [B, T+1, W-1, channels], state snapshots [B, T+1, N, K, V] float32),
    snapshot t the states after the first t tokens (0: the ones passed in). kw: `kda_decode_layer_reference`'s."""
    ys, convs, states = [], [conv_state], [state.astype(jnp.float32)]
    for t in range(q_raw.shape[1]):
        y, conv, s = kda_decode_layer_reference(
            q_raw[:, t], k_raw[:, t], v_raw[:, t], convs[-1], conv_weights, f[:, t], a_log, dt_bias, b_logits[:, t],
            z[:, t], norm_weight, states[-1], valid[:, t], valid[:, t].astype(jnp.int32), **kw,
        )  # fmt: skip
        ys.append(y)
        convs.append(conv)
        states.append(s)
    return jnp.stack(ys, axis=1), jnp.stack(convs, axis=1), jnp.stack(states, axis=1)
