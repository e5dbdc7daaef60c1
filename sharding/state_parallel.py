"""State-parallel linear attention: KDA prefill split along the sequence over the `cp` mesh axis.

Each device (1) computes the state summary (M, E) of each sequence piece it holds, (2) `all_gather`s the
summaries over `cp`, (3) folds the summaries of all earlier pieces into each piece's start state, and
(4) runs its pieces from those states (ARCH_SPEC §2). Work and activation memory per device drop with cp;
the exchange is K*(K+V) float32 values per head and piece.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from pallas_kernels.linear_attention import apply_summary, kda, kda_state_summary
from sharding.zigzag import piece_table


def kda_context_parallel(
    q,
    k,
    v,
    g,
    beta,
    *,
    mesh: Mesh,
    axis: str = "cp",
    layout: str = "sequential",
    initial_state=None,
    scale=None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
):
    """`kda` over a sequence laid out along `axis` (device-major, see `sharding.zigzag.layout_order`).

    Inputs are [B, T, N, ...] in layout order; returns (o in layout order, final state of the whole
    sequence, replicated). Equal to `kda` on the unpermuted sequence."""
    cp = mesh.shape[axis]
    table = piece_table(cp, layout)  # [cp, pieces per device]
    per_dev = table.shape[1]
    order = np.argsort(table.reshape(-1))  # gathered (device-major) -> sequence order
    b, _, n, dk = q.shape
    dv = v.shape[-1]
    s0 = jnp.zeros((b, n, dk, dv), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)

    def pieces(x):  # local [B, per_dev * L, ...] -> [per_dev] list of [B, L, ...]
        return jnp.split(x, per_dev, axis=1)

    def local(q, k, v, g, beta, s0):
        kp, vp, gp, bp = (pieces(x) for x in (k, v, g, beta))
        summaries = [
            kda_state_summary(kp[i], vp[i], gp[i], bp[i], use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)
            for i in range(per_dev)
        ]
        m = jnp.stack([s[0] for s in summaries])  # [per_dev, B, N, K, K]
        e = jnp.stack([s[1] for s in summaries])
        m_all = jax.lax.all_gather(m, axis).reshape(cp * per_dev, *m.shape[1:])[order]  # sequence order
        e_all = jax.lax.all_gather(e, axis).reshape(cp * per_dev, *e.shape[1:])[order]
        s0 = jax.lax.pcast(s0, (axis,), to="varying")  # the fold mixes it with gathered (device-typed) values

        def step(s, me):
            return apply_summary(me, s), s  # carry the state after the piece; emit the state before it

        s_final, before = jax.lax.scan(step, s0, (m_all, e_all))  # before[p]: start state of piece p
        mine = jnp.asarray(table)[jax.lax.axis_index(axis)]  # global indices of this device's pieces
        qp = pieces(q)
        outs = [
            kda(
                qp[i],
                kp[i],
                vp[i],
                gp[i],
                bp[i],
                initial_state=before[mine[i]],
                scale=scale,
                use_qk_l2norm=use_qk_l2norm,
                impl="chunked",
                chunk_size=chunk_size,
            )[0]
            for i in range(per_dev)
        ]
        # s_final is the same on every device (all folded the same gathered summaries); return one per device.
        return jnp.concatenate(outs, axis=1), s_final[None]

    seq = P(None, axis)  # inputs / outputs: the time axis is split over cp, everything else whole
    # in: q, k, v, g, beta split along time over cp; the initial state replicated.
    # out: o split along time like the inputs; the final state identical on every device.
    # jit lets XLA place unsharded inputs onto the specs (a no-op when they already are, or inside a jit).
    fn = jax.shard_map(local, mesh=mesh, in_specs=(seq, seq, seq, seq, seq, P()), out_specs=(seq, P(axis)))
    o, s_final = jax.jit(fn)(q, k, v, g, beta, s0)
    return o, s_final[0]
