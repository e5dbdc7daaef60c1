"""KDA over a sequence split across devices: the body that runs inside `jax.shard_map` over a mesh axis.

Each device holds `pieces` equal slices of the sequence (their global indices in `table[device]`). It
computes the state summary (M, E) of each piece, all-gathers them, folds the summaries of all earlier pieces
into each piece's start state, and runs its pieces from there (docs/architecture.md §4)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.linear_attention.reference import apply_summary, kda_chunked, kda_state_summary


def split_pieces(x: jax.Array, pieces: int) -> list[jax.Array]:
    return jnp.split(x, pieces, axis=1)


def gather_in_sequence_order(x: jax.Array, axis: str, table: np.ndarray) -> jax.Array:
    """Per-piece values [pieces, ...] from every device -> [total pieces, ...] in sequence order."""
    gathered = jax.lax.all_gather(x, axis)  # [cp, pieces, ...] device-major
    return gathered.reshape(-1, *x.shape[1:])[np.argsort(table.reshape(-1))]


def kda_sequence_parallel(
    q,
    k,
    v,
    g,
    beta,
    *,
    axis: str,
    table,
    initial_state=None,
    scale=None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
):
    """Inside shard_map over `axis`: local [B, pieces*L, N, ...] -> (o local, final state of the sequence)."""
    table = np.asarray(table)
    per_dev = table.shape[1]
    if table.size == 1:  # one piece in all (cp = 1): no summaries to exchange, the chunked pass is the answer
        return kda_chunked(
            q,
            k,
            v,
            g,
            beta,
            initial_state=initial_state,
            scale=scale,
            use_qk_l2norm=use_qk_l2norm,
            chunk_size=chunk_size,
        )
    kp, vp, gp, bp = (split_pieces(x, per_dev) for x in (k, v, g, beta))
    summaries = [
        kda_state_summary(kp[i], vp[i], gp[i], bp[i], use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)
        for i in range(per_dev)
    ]
    m_all = gather_in_sequence_order(jnp.stack([s[0] for s in summaries]), axis, table)
    e_all = gather_in_sequence_order(jnp.stack([s[1] for s in summaries]), axis, table)
    if initial_state is None:
        s0 = jnp.zeros_like(e_all[0])
    else:  # the fold mixes it with gathered (device-typed) values
        s0 = jax.lax.pcast(initial_state.astype(jnp.float32), (axis,), to="varying")

    def step(s, me):
        return apply_summary(me, s), s  # carry the state after the piece; emit the state before it

    s_final, before = jax.lax.scan(step, s0, (m_all, e_all))
    mine = jnp.asarray(table)[jax.lax.axis_index(axis)]
    qp = split_pieces(q, per_dev)
    outs = [
        kda_chunked(
            qp[i],
            kp[i],
            vp[i],
            gp[i],
            bp[i],
            initial_state=before[mine[i]],
            scale=scale,
            use_qk_l2norm=use_qk_l2norm,
            chunk_size=chunk_size,
        )[0]
        for i in range(per_dev)
    ]
    return jnp.concatenate(outs, axis=1), s_final
