"""Pallas kernel: a KDA layer's whole decode token between its projections and o_proj, in one launch.

One program per (sequence b, head n) does, with the head's whole state S [K, V] in float32:

    q, k, v = SiLU(Σ_j w_j x_{t-W+1+j}) over the W-1 cached raw inputs and this token's (per channel)
    the cached inputs shift by one where the row has a token (n_new = 1), else stay
    q, k ← L2-normalised (eps 1e-6 inside the root), q ← q · K^-1/2
    g = −exp(A_log) ⊙ softplus(f + dt_bias)  (or lb·σ(exp(A_log)(f + dt_bias))),  β = σ(b); both 0 if padded
    S ← Diag(exp g) S;   u = β (v − Sᵀk);   S ← S + k uᵀ;   o = Sᵀq  (rounded to the compute dtype)
    y = γ ⊙ o / sqrt(mean(o²) + ε) ⊙ act(z)      (act σ, or SiLU for Qwen's Gated DeltaNet)

Kimi's layout (one q/k head per value head, K = V): the conv state [B, W-1, 3·N·K] and S are updated in place
(`input_output_aliases`). Qwen's grouped layout (N_k q/k heads, value head n reading q / k head n // (N / N_k),
V ≠ K allowed): program (b, n) reads its q / k head's conv channels and writes them back (the N / N_k programs
of a group write the same values), the v channels its own; the conv tails come back as q | k | v arrays that the
caller joins. Every intermediate rounds where the model's unfused path rounds (q, k, v and o to the compute
dtype), so the two agree to float32 summation order. Generic Pallas: Triton lowering on GPU, interpret mode on
CPU (tests). K and V powers of two.

`verify_layer_pallas` runs the same per-token arithmetic (`token_step`) over a speculative verify block of T
tokens, one program per (sequence, head, block of value columns), the state block on chip across the block and
written after every token (the snapshots a rollback picks from); the gated RMSNorm, which needs a head's whole
value row, runs after it.

Why one launch: at a batch-1 decode step XLA runs the work around the recurrence (the short-conv window, its
split into q, k, v, the new conv state, the gates with their padding masks, the gated RMSNorm's reduction
and multiply) as several small kernels per layer beside the state update; measurements in
docs/performance.md#kda-decode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._pallas import sum_rows, triton_params
from pallas_kernels.linear_attention.reference import gated_rms_norm
from pallas_kernels.linear_attention.tuning import VERIFY_BLOCK_V
from pallas_kernels.projection.api import SplitK


def _kernel(*refs, width, scalar, lower_bound, eps, dt, grouped, gate):
    """grouped: the conv state comes as three input blocks (q, k [W-1, K], v [W-1, V]) and goes out as three."""
    if grouped:
        (qr_ref, kr_ref, vr_ref, csq_ref, csk_ref, csv_ref, wq_ref, wk_ref, wv_ref, f_ref, alog_ref, dtb_ref, bl_ref,
         z_ref, nw_ref, valid_ref, nnew_ref, s_ref, y_ref, oq_ref, ok_ref, ov_ref, s_out_ref) = refs  # fmt: skip
        cs_in, cs_out = (csq_ref, csk_ref, csv_ref), (oq_ref, ok_ref, ov_ref)

        def read(part, j):
            return cs_in[part][j, :]

        def write(part, j, x):
            cs_out[part][j, :] = x.astype(cs_out[part].dtype)
    else:
        (qr_ref, kr_ref, vr_ref, cs_ref, wq_ref, wk_ref, wv_ref, f_ref, alog_ref, dtb_ref, bl_ref, z_ref, nw_ref,
         valid_ref, nnew_ref, s_ref, y_ref, cs_out_ref, s_out_ref) = refs  # fmt: skip

        def read(part, j):
            return cs_ref[j, part, :]

        def write(part, j, x):
            cs_out_ref[j, part, :] = x.astype(cs_out_ref.dtype)

    shift = nnew_ref[0] > 0  # this row has a token: the cached inputs move by one
    live = valid_ref[0] > 0

    def val(ref):  # a projection's value for this head: its S partial sums added, rounded to the compute dtype
        return sum_rows(ref).astype(dt)

    window = [[read(part, j).astype(dt) for j in range(width - 1)] for part in range(3)]
    o, window, s = token_step(
        window, [val(r) for r in (qr_ref, kr_ref, vr_ref)], (wq_ref, wk_ref, wv_ref), val(f_ref), val(bl_ref),
        s_ref[...], live, shift, alog_ref, dtb_ref, scalar=scalar, lower_bound=lower_bound, dt=dt,
    )  # fmt: skip
    for part in range(3):
        for j in range(width - 1):
            write(part, j, window[part][j])
    s_out_ref[...] = s
    zv = val(z_ref).astype(jnp.float32)
    y = o * jax.lax.rsqrt(jnp.mean(o * o) + eps) * nw_ref[...].astype(jnp.float32)
    act = 1.0 / (1.0 + jnp.exp(-zv))
    y_ref[...] = (y * (act if gate == "sigmoid" else zv * act)).astype(y_ref.dtype)


def token_step(window, raw, w_refs, f, b_logit, s, live, shift, alog_ref, dtb_ref, *, scalar, lower_bound, dt):
    """One token of one head (or of a V-block of it), on values: window (q, k, v) each the W-1 cached raw inputs
    [C_part] oldest first and raw (q, k, v) this token's, in the compute dtype dt; w_refs the conv kernels
    [W, C_part]; f [K] or [1], b_logit [1] (dt); s [K, V_block] float32 (v, s and o may be any block of the
    head's V columns: each column's update reads only its own); live / shift scalars -> (o [V_block] float32,
    rounded to dt as the unfused path's output, the window after the token, new s). Shared by the decode-layer
    kernel (one token) and the verify-layer kernel (a block of tokens)."""
    f32 = jnp.float32

    def conv(part):  # one of q, k, v for this head: after SiLU, rounded to the compute dtype
        rows = window[part] + [raw[part]]
        u = jnp.zeros(rows[-1].shape, f32)
        for j, x in enumerate(rows):
            u = u + w_refs[part][j, :].astype(f32) * x.astype(f32)
        return (u / (1.0 + jnp.exp(-u))).astype(dt).astype(f32)

    q, k, v = conv(0), conv(1), conv(2)
    width = len(window[0]) + 1
    window = [[jnp.where(shift, (w + [x])[j + 1], w[j]) for j in range(width - 1)]
              for w, x in zip(window, raw, strict=True)]  # fmt: skip
    q = q * jax.lax.rsqrt(jnp.sum(q * q) + 1e-6) * (q.shape[0] ** -0.5)
    k = k * jax.lax.rsqrt(jnp.sum(k * k) + 1e-6)

    fv = f.astype(f32) + dtb_ref[...].astype(f32)  # [K] or [1]
    a = jnp.exp(alog_ref[...].astype(f32))  # [1]
    if lower_bound is not None:
        g = lower_bound * (1.0 / (1.0 + jnp.exp(-a * fv)))
    else:
        g = -a * jnp.where(fv > 20.0, fv, jnp.log1p(jnp.exp(jnp.minimum(fv, 20.0))))
    g = jnp.where(live, g, 0.0)
    beta = jnp.where(live, 1.0 / (1.0 + jnp.exp(-b_logit.astype(f32))), 0.0)  # [1]

    decay = jnp.exp(g)
    s = s * (jnp.broadcast_to(decay, k.shape) if scalar else decay)[:, None]  # [K, V]
    u = beta * (v - jnp.sum(k[:, None] * s, axis=0))  # [V]
    s = s + k[:, None] * u[None, :]
    o = jnp.sum(q[:, None] * s, axis=0).astype(dt).astype(f32)  # [V], rounded as the unfused path's output
    return o, window, s


def _split(x, unit: int):
    """A projection input as the kernel reads it: (partials [S, B, W], block offset in `unit`-wide blocks) — an
    array [B, C] is one partial; a one-row `SplitK` is its partial sums, read in place."""
    if isinstance(x, SplitK):
        return x.parts.reshape(x.parts.shape[0], 1, -1), x.start // unit
    return x.reshape(1, *x.shape), 0


@functools.partial(
    jax.jit,
    static_argnames=("num_heads", "scalar_decay", "lower_bound", "eps", "interpret", "num_warps", "dtype",
                     "num_k_heads", "v_head_dim", "gate"),
)  # fmt: skip
def decode_layer_pallas(
    q_raw, k_raw, v_raw, conv_state, conv_weights, f, a_log, dt_bias, b_logits, z, norm_weight, state, valid,
    n_new, *, num_heads, scalar_decay, lower_bound, eps, interpret, num_warps=4, dtype=None, num_k_heads=None,
    v_head_dim=None, gate="sigmoid",
):  # fmt: skip
    """Shapes as `reference.kda_decode_layer_reference` (K and V powers of two; in the grouped layout 2·N_k·K a
    multiple of V) -> (y [B, N, V] in the compute dtype, new conv state, new state); in Kimi's layout conv_state
    and state are updated in place, in the grouped one the state. q_raw, k_raw, v_raw, f, z, b_logits may be
    one-row `projection.SplitK`s lined up with the heads (start a multiple of the head width, of 1 for the
    one-per-head b_logits / scalar f): the kernel adds their partial sums; dtype is then the compute dtype."""
    b, n = conv_state.shape[0], num_heads
    dt = jnp.dtype(dtype or q_raw.dtype)
    nk = num_k_heads or n
    hd = state.shape[2]  # K
    dv = v_head_dim or hd
    r = n // nk
    grouped = nk != n or dv != hd
    w = conv_state.shape[1] + 1

    def split_spec(x, unit, per=1):  # per: value heads per block (a q / k head serves r of them)
        parts, off = _split(x, unit)
        spec = pl.BlockSpec((parts.shape[0], None, unit), lambda i, h, off=off: (0, i, off + h // per))
        return parts, spec

    (qp, q_spec), (kp, k_spec) = (split_spec(x, hd, r) for x in (q_raw, k_raw))
    (vp, v_spec), (zp, z_spec) = (split_spec(x, dv) for x in (v_raw, z))
    fp, f_spec = split_spec(f, 1 if scalar_decay else hd)
    bp, b_spec = split_spec(b_logits, 1)
    vec = pl.BlockSpec((None, None, dv), lambda i, h: (i, h, 0))
    state_spec = pl.BlockSpec((None, None, hd, dv), lambda i, h: (i, h, 0, 0))
    row = pl.BlockSpec((None, 1), lambda i, h: (i, 0))
    kernel = functools.partial(
        _kernel, width=w, scalar=scalar_decay, lower_bound=lower_bound, eps=eps, dt=dt, grouped=grouped, gate=gate
    )
    gates = [
        pl.BlockSpec((None, 1), lambda i, h: (h, 0)),
        pl.BlockSpec((None, 1) if scalar_decay else (None, hd), lambda i, h: (h, 0)),
        b_spec, z_spec, pl.BlockSpec((dv,), lambda i, h: (0,)), row, row, state_spec,
    ]  # fmt: skip
    gate_args = (
        a_log.reshape(n, 1), dt_bias.reshape(n, -1), bp, zp, norm_weight, valid.astype(jnp.int32).reshape(b, 1),
        n_new.astype(jnp.int32).reshape(b, 1), state.astype(jnp.float32),
    )  # fmt: skip
    params = dict(interpret=interpret, name="kda_decode_layer", **triton_params(interpret, num_warps, 1))
    if not grouped:
        conv_spec = pl.BlockSpec((None, w - 1, 3, None, hd), lambda i, h: (i, 0, 0, h, 0))
        weight_spec = pl.BlockSpec((w, None, hd), lambda i, h: (0, h, 0))
        y, conv, s = pl.pallas_call(
            kernel,
            grid=(b, n),
            in_specs=[q_spec, k_spec, v_spec, conv_spec, weight_spec, weight_spec, weight_spec, f_spec, *gates],
            out_specs=[vec, conv_spec, state_spec],
            out_shape=[
                jax.ShapeDtypeStruct((b, n, hd), dt),
                jax.ShapeDtypeStruct((b, w - 1, 3, n, hd), conv_state.dtype),
                jax.ShapeDtypeStruct(state.shape, jnp.float32),
            ],
            input_output_aliases={3: 1, 15: 2},
            **params,
        )(
            qp, kp, vp, conv_state.reshape(b, w - 1, 3, n, hd), *(x.reshape(w, n, hd) for x in conv_weights), fp,
            *gate_args,
        )  # fmt: skip
        return y, conv.reshape(conv_state.shape), s
    # grouped: the q, k and v channels of the one conv state array, read by three block specs (v's blocks start
    # at channel 2·N_k·K, a whole number of V-wide blocks), written to three arrays
    vstart = 2 * nk * hd // dv
    qk_conv = [pl.BlockSpec((None, w - 1, hd), lambda i, h, p=p: (i, 0, p * nk + h // r)) for p in (0, 1)]
    v_conv = pl.BlockSpec((None, w - 1, dv), lambda i, h: (i, 0, vstart + h))
    qk_out = pl.BlockSpec((None, w - 1, hd), lambda i, h: (i, 0, h // r))
    v_out = pl.BlockSpec((None, w - 1, dv), lambda i, h: (i, 0, h))
    qk_weight = pl.BlockSpec((w, hd), lambda i, h: (0, h // r))
    v_weight = pl.BlockSpec((w, dv), lambda i, h: (0, h))
    y, cq, ck, cv, s = pl.pallas_call(
        kernel,
        grid=(b, n),
        in_specs=[q_spec, k_spec, v_spec, *qk_conv, v_conv, qk_weight, qk_weight, v_weight, f_spec, *gates],
        out_specs=[vec, qk_out, qk_out, v_out, state_spec],
        out_shape=[
            jax.ShapeDtypeStruct((b, n, dv), dt),
            jax.ShapeDtypeStruct((b, w - 1, nk * hd), conv_state.dtype),
            jax.ShapeDtypeStruct((b, w - 1, nk * hd), conv_state.dtype),
            jax.ShapeDtypeStruct((b, w - 1, n * dv), conv_state.dtype),
            jax.ShapeDtypeStruct(state.shape, jnp.float32),
        ],
        input_output_aliases={17: 4},
        **params,
    )(qp, kp, vp, conv_state, conv_state, conv_state, *conv_weights, fp, *gate_args)  # fmt: skip
    return y, jnp.concatenate([cq, ck, cv], axis=-1), s


def _verify_kernel(qr_ref, kr_ref, vr_ref, csq_ref, csk_ref, csv_ref, wq_ref, wk_ref, wv_ref, f_ref, alog_ref,
                   dtb_ref, bl_ref, valid_ref, s_ref, o_ref, oq_ref, ok_ref, ov_ref, s_out_ref, *, tokens, width,
                   scalar, lower_bound, dt):  # fmt: skip
    """A block of `tokens` tokens of one (sequence, head, V-block): `token_step` after token, the state block
    kept on chip; snapshot t (0 .. tokens) of the conv window and the state is what they are after t tokens.
    Every V-block's program computes its head's q and k (and writes the same q / k conv snapshots)."""
    cs_in, cs_out = (csq_ref, csk_ref, csv_ref), (oq_ref, ok_ref, ov_ref)
    window = [[cs_in[part][j, :].astype(dt) for j in range(width - 1)] for part in range(3)]
    s = s_ref[...]

    def snapshot(t, window, s):
        for part in range(3):
            for j in range(width - 1):
                cs_out[part][t, j, :] = window[part][j].astype(cs_out[part].dtype)
        s_out_ref[t] = s

    snapshot(0, window, s)
    for t in range(tokens):
        live = valid_ref[t] > 0  # a padded token (or a finished row) leaves the window and the state alone
        o, window, s = token_step(
            window, [r[t, :].astype(dt) for r in (qr_ref, kr_ref, vr_ref)], (wq_ref, wk_ref, wv_ref),
            f_ref[t, :].astype(dt), bl_ref[t, :].astype(dt), s, live, live, alog_ref, dtb_ref, scalar=scalar,
            lower_bound=lower_bound, dt=dt,
        )  # fmt: skip
        o_ref[t, :] = o.astype(o_ref.dtype)
        snapshot(t + 1, window, s)


@functools.partial(
    jax.jit,
    static_argnames=("num_heads", "scalar_decay", "lower_bound", "eps", "interpret", "num_warps", "num_k_heads",
                     "v_head_dim", "gate", "block_v"),
)  # fmt: skip
def verify_layer_pallas(
    q_raw, k_raw, v_raw, conv_state, conv_weights, f, a_log, dt_bias, b_logits, z, norm_weight, state, valid, *,
    num_heads, scalar_decay, lower_bound, eps, interpret, num_warps=4, num_k_heads=None, v_head_dim=None,
    gate="sigmoid", block_v=None,
):  # fmt: skip
    """A block of T tokens per sequence (`reference.kda_verify_layer_reference`'s shapes: q_raw [B, T, N_k·K],
    ..., valid [B, T]) in one launch, one program per (sequence, head, block of `block_v` value columns; default
    `tuning.VERIFY_BLOCK_V`) -> (y [B, T, N, V] in q_raw's dtype, conv snapshots [B, T+1, W-1, channels], state
    snapshots [B, T+1, N, K, V] float32). Each token's state arithmetic is the decode-layer kernel's
    (`token_step`) on the program's columns; the gated RMSNorm, which needs all V columns of a head, runs after
    the kernel (`reference.gated_rms_norm`). The state block stays on chip between tokens and is written once
    per snapshot. Why the V split: one program per head kept the [K, V] float32 state in registers of one SM
    (32 programs at Kimi's batch 1), slower than the five decode-layer launches it replaced."""
    b, t, _ = q_raw.shape
    n = num_heads
    dt = jnp.dtype(q_raw.dtype)
    nk = num_k_heads or n
    hd = state.shape[2]
    dv = v_head_dim or hd
    r = n // nk
    bv = min(dv, hd, block_v or VERIFY_BLOCK_V)  # divides 2·N_k·K: the v channels start on a block boundary
    nv = dv // bv
    w = conv_state.shape[1] + 1
    vstart = 2 * nk * hd // bv

    def spec(block, index):
        return pl.BlockSpec(block, lambda i, h, c: index(i, h, c))

    qk_in = spec((None, t, hd), lambda i, h, c: (i, 0, h // r))
    v_in = spec((None, t, bv), lambda i, h, c: (i, 0, h * nv + c))
    qk_conv = [spec((None, w - 1, hd), lambda i, h, c, p=p: (i, 0, p * nk + h // r)) for p in (0, 1)]
    v_conv = spec((None, w - 1, bv), lambda i, h, c: (i, 0, vstart + h * nv + c))
    qk_weight = spec((w, hd), lambda i, h, c: (0, h // r))
    v_weight = spec((w, bv), lambda i, h, c: (0, h * nv + c))
    gates = [
        spec((None, t, 1 if scalar_decay else hd), lambda i, h, c: (i, 0, h)),  # f
        spec((None, 1), lambda i, h, c: (h, 0)),  # A_log
        spec((None, 1) if scalar_decay else (None, hd), lambda i, h, c: (h, 0)),  # dt_bias
        spec((None, t, 1), lambda i, h, c: (i, 0, h)),  # b_logits
        spec((None, t), lambda i, h, c: (i, 0)),  # valid
        spec((None, None, hd, bv), lambda i, h, c: (i, h, 0, c)),  # state
    ]  # fmt: skip
    out_specs = [
        spec((None, t, None, bv), lambda i, h, c: (i, 0, h, c)),  # o
        spec((None, t + 1, w - 1, hd), lambda i, h, c: (i, 0, 0, h // r)),  # q conv snapshots
        spec((None, t + 1, w - 1, hd), lambda i, h, c: (i, 0, 0, h // r)),  # k
        spec((None, t + 1, w - 1, bv), lambda i, h, c: (i, 0, 0, h * nv + c)),  # v
        spec((None, t + 1, None, hd, bv), lambda i, h, c: (i, 0, h, 0, c)),  # state snapshots
    ]
    kernel = functools.partial(_verify_kernel, tokens=t, width=w, scalar=scalar_decay, lower_bound=lower_bound, dt=dt)
    o, cq, ck, cv, s = pl.pallas_call(
        kernel,
        grid=(b, n, nv),
        in_specs=[qk_in, qk_in, v_in, *qk_conv, v_conv, qk_weight, qk_weight, v_weight, *gates],
        out_specs=out_specs,
        out_shape=[
            jax.ShapeDtypeStruct((b, t, n, dv), dt),
            jax.ShapeDtypeStruct((b, t + 1, w - 1, nk * hd), conv_state.dtype),
            jax.ShapeDtypeStruct((b, t + 1, w - 1, nk * hd), conv_state.dtype),
            jax.ShapeDtypeStruct((b, t + 1, w - 1, n * dv), conv_state.dtype),
            jax.ShapeDtypeStruct((b, t + 1, n, hd, dv), jnp.float32),
        ],
        interpret=interpret,
        name="kda_verify_layer",
        **triton_params(interpret, num_warps, 1),
    )(
        q_raw, k_raw, v_raw, conv_state, conv_state, conv_state, *conv_weights, f, a_log.reshape(n, 1),
        dt_bias.reshape(n, -1), b_logits.reshape(b, t, n), valid.astype(jnp.int32), state.astype(jnp.float32),
    )  # fmt: skip
    y = gated_rms_norm(o, z.reshape(b, t, n, dv), norm_weight, eps, dt, gate)
    return y, jnp.concatenate([cq, ck, cv], axis=-1), s
