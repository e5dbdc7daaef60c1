"""State-parallel linear attention: KDA prefill split along the sequence over the `cp` mesh axis.

Each device (1) computes the state summary (M, E) of each sequence piece it holds, (2) `all_gather`s the
summaries over `cp`, (3) folds the summaries of all earlier pieces into each piece's start state, and
(4) runs its pieces from those states (docs/architecture.md §4). Work and activation memory per device drop with cp;
the exchange is K*(K+V) float32 values per head and piece.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from pallas_kernels.linear_attention import kda_sequence_parallel
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
    layout: str = "zigzag",
    initial_state=None,
    scale=None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
):
    """`kda` over a sequence laid out along `axis` (device-major, see `sharding.zigzag.layout_order`).

    Inputs are [B, T, N, ...] in layout order; returns (o in layout order, final state of the whole
    sequence, replicated). Equal to `kda` on the unpermuted sequence."""
    table = piece_table(mesh.shape[axis], layout)  # [cp, pieces per device]
    b, _, n, dk = q.shape
    dv = v.shape[-1]
    s0 = jnp.zeros((b, n, dk, dv), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)

    def local(q, k, v, g, beta, s0):
        o, s_final = kda_sequence_parallel(
            q,
            k,
            v,
            g,
            beta,
            axis=axis,
            table=table,
            initial_state=s0,
            scale=scale,
            use_qk_l2norm=use_qk_l2norm,
            chunk_size=chunk_size,
        )
        # s_final is the same on every device (all folded the same gathered summaries); return one per device.
        return o, s_final[None]

    seq = P(None, axis)  # inputs / outputs: the time axis is split over cp, everything else whole
    # in: q, k, v, g, beta split along time over cp; the initial state replicated.
    # out: o split along time like the inputs; the final state identical on every device.
    # jit lets XLA place unsharded inputs onto the specs (a no-op when they already are, or inside a jit).
    fn = jax.shard_map(local, mesh=mesh, in_specs=(seq, seq, seq, seq, seq, P()), out_specs=(seq, P(axis)))
    o, s_final = jax.jit(fn)(q, k, v, g, beta, s0)
    return o, s_final[0]
