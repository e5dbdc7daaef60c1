"""Whole-model context-parallel prefill: the sequence is split over the `cp` mesh axis (zigzag by default).

Token-local work (projections, norms, MoE, AttnRes) runs on each device's own tokens; MLA and indexer layers
gather the compressed latents and indexer keys over `cp` (each device then scores its queries, at their true
positions, against the whole causal prefix); KDA layers run state-parallel with a conv halo. Logits come
back in position order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from hybrid_jax.cache import ContextParallel, StepInfo
from hybrid_jax.model import HybridLM
from sharding.zigzag import layout_order, piece_table


def forward_context_parallel(model: HybridLM, input_ids, *, mesh: Mesh, axis: str = "cp", layout: str = "zigzag"):
    """Full causal forward (no cache) of ids [B, T] with T split over `axis`: float32 logits [B, T, vocab],
    equal to `model(input_ids)`. T must be a multiple of the number of pieces (2*cp for zigzag)."""
    model._check_ids(input_ids)
    cp = mesh.shape[axis]
    b, t = input_ids.shape
    order = layout_order(t, cp, layout)
    cpi = ContextParallel(axis=axis, table=tuple(map(tuple, piece_table(cp, layout).tolist())))
    graphdef, state = nnx.split(model)

    def local(state, ids, positions):
        m = nnx.merge(graphdef, state)
        tl = ids.shape[1]
        info = StepInfo(
            positions=positions,
            valid=jnp.ones((b, tl), bool),
            n_new=jnp.full((b,), tl, jnp.int32),
            page_table=jnp.arange(b, dtype=jnp.int32)[:, None],
            kv_lengths=jnp.full((b,), t, jnp.int32),
            mode="prefill",
            cp=cpi,
        )
        logits, _ = m._run(ids, info, None, None)
        return logits

    seq = P(None, axis)
    # in: parameters replicated over cp; token ids and their positions split along time in layout order.
    # out: logits split along time in layout order.
    # Only cp is manual: the other mesh axes (tp, dp) stay automatic, so tensor-parallel parameter shardings
    # are kept and XLA partitions each device's share of the work over them.
    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), seq, seq), out_specs=seq, axis_names={axis}))
    positions = jnp.broadcast_to(jnp.asarray(order, jnp.int32), (b, t))
    logits = fn(state, jnp.asarray(input_ids)[:, order], positions)
    return logits[:, np.argsort(order)]
