"""Whole-model context-parallel prefill: the sequence is split over the `cp` mesh axis (zigzag by default).

Token-local work (projections, norms, MoE, AttnRes) runs on each device's own tokens; MLA and indexer layers
gather the compressed latents and indexer keys over `cp` (each device then scores its queries, at their true
positions, against the whole causal prefix); KDA layers run state-parallel with a conv halo. Logits come
back in position order. With a cache, the prefill also fills it for decode: every device writes the gathered
latents / indexer keys into its copy of the paged pools and computes the same final KDA states, so the cache
leaves the shard_map replicated over `cp` (and sharded over the automatic axes as it came in).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from hybrid_jax.cache import ContextParallel, HybridCache, StepInfo, is_concrete
from hybrid_jax.model import HybridLM
from sharding.zigzag import layout_order, piece_table


def padded_length(t: int, cp: int, layout: str) -> int:
    """The length a prompt of t tokens is padded to for `layout` over cp devices: a whole number of equal
    pieces (2 x cp for zigzag, cp for sequential)."""
    pieces = piece_table(cp, layout).size
    return -(-t // pieces) * pieces


@functools.lru_cache(maxsize=32)
def _compiled(mesh: Mesh, axis: str, layout: str, cp: int, b: int, t: int, t_pad: int, last_only: bool, cached: bool):
    """The jitted CP prefill of t real tokens laid out as t_pad (pads at positions t.. t_pad - 1: not valid,
    so they write no cache row, change no state and are never visible to a real query)."""
    table = piece_table(cp, layout)
    cpi = ContextParallel(axis=axis, table=tuple(map(tuple, table.tolist())))
    # The last real position t - 1 lives in piece p* at offset o*; piece p* is device d*'s j*-th. Every device
    # takes its own row at that local offset and the caller keeps device d*'s.
    size = t_pad // table.size
    d_last, j_last = (int(a[0]) for a in np.nonzero(table == (t - 1) // size))
    last_local = j_last * size + (t - 1) % size

    def local(graphdef, state, ids, positions, valid, layers, page_table, kv_lengths):
        model = nnx.merge(graphdef, state)
        info = StepInfo(
            positions=positions,
            valid=valid,
            n_new=jnp.full((b,), t, jnp.int32),
            page_table=page_table,
            kv_lengths=kv_lengths,
            mode="prefill",
            cp=cpi,
        )
        last = jnp.full((b,), last_local, jnp.int32) if last_only else None
        logits, new_layers = model.forward(ids, info, layers, last)
        return (logits[None] if last_only else logits), new_layers

    seq = P(None, axis)
    order = layout_order(t_pad, cp, layout)

    # The model is a jit argument (a pytree: cheaper to pass than nnx.split on the host every call); its
    # graph definition is static, so it is closed over inside the trace.
    def run(model, ids, start, layers, page_table):
        graphdef, state = nnx.split(model)
        # in: parameters and cache replicated over cp; token ids, their positions and validity split along time
        # in layout order. out: logits split along time in layout order (last_only: one row per device,
        # stacked), the filled cache replicated. Only cp is manual: the other mesh axes (tp, dp) stay
        # automatic, so the tensor-parallel shardings of parameters and caches are kept and XLA partitions
        # each device's share. check_vma=False: the cache leaves are computed from all-gathered values,
        # identical on every device but typed as device-varying; they are returned as one replicated value.
        fn = jax.shard_map(
            functools.partial(local, graphdef),
            mesh=mesh,
            in_specs=(P(), seq, seq, seq, P(), P(), P()),
            out_specs=(P(axis) if last_only else seq, P()),
            axis_names={axis},
            check_vma=not cached,
        )
        positions = start[:, None] + jnp.asarray(order, jnp.int32)[None, :]
        valid = jnp.broadcast_to(jnp.asarray(order < t)[None, :], (b, t_pad))
        ids = jnp.pad(ids, [(0, 0), (0, t_pad - t)])  # id 0 at the pads: in every vocabulary, never read
        logits, new_layers = fn(state, ids[:, order], positions, valid, layers, page_table, start + t)
        return (logits[d_last] if last_only else logits[:, np.argsort(order)[:t]]), new_layers

    return jax.jit(run)


def prefill_context_parallel(
    model: HybridLM,
    input_ids,
    cache: HybridCache | None = None,
    *,
    mesh: Mesh,
    axis: str = "cp",
    layout: str = "zigzag",
    last_only: bool = False,
):
    """Prefill of ids [B, T] with T split over the mesh axis `axis`; every row takes all T tokens.

    Returns float32 logits [B, T, vocab] ([B, vocab] at position T-1 with `last_only`) and, when a cache is
    given, the cache filled for decode: the result equals `model.prefill(input_ids, cache)` (and the
    logits `model(input_ids)` for an empty cache). Any T: the sequence is padded to `padded_length` (a whole
    number of pieces: 2*cp for zigzag, cp for sequential) with tokens that are not valid, which change no
    logit, state or cache row; each piece must hold at least kda_conv_size - 1 tokens."""
    model._check_ids(input_ids)
    if axis not in mesh.shape:
        raise ValueError(f"mesh axes {tuple(mesh.axis_names)} have no context-parallel axis {axis!r}")
    cp = mesh.shape[axis]
    b, t = np.shape(input_ids)
    if cp == 1:  # one device holds everything: zigzag's two pieces would only add a state summary
        layout = "sequential"
    t_pad = padded_length(t, cp, layout)
    if cache is None:
        start = jnp.zeros((b,), jnp.int32)
        layers, page_table = None, jnp.arange(b, dtype=jnp.int32)[:, None]
    else:
        if cache.batch_size != b:
            raise ValueError(f"input batch {b} != cache batch {cache.batch_size}")
        if is_concrete(cache.lengths):
            over = np.nonzero(np.asarray(cache.lengths) + t > cache.max_len)[0]
            if over.size:
                i = int(over[0])
                raise ValueError(
                    f"sequence {i}: {int(cache.lengths[i])} cached + {t} new tokens exceed the cache "
                    f"capacity max_len={cache.max_len}"
                )
        start, layers, page_table = cache.lengths, cache.layers, cache.page_table
    fn = _compiled(mesh, axis, layout, cp, b, t, t_pad, last_only, cache is not None)
    logits, new_layers = fn(model, jnp.asarray(input_ids), start, layers, page_table)
    if cache is None:
        return logits
    filled = HybridCache(
        layers=new_layers,
        page_table=cache.page_table,
        lengths=cache.lengths + t,
        max_len=cache.max_len,
        page_size=cache.page_size,
    )
    return logits, filled


def forward_context_parallel(model: HybridLM, input_ids, *, mesh: Mesh, axis: str = "cp", layout: str = "zigzag"):
    """Full causal forward (no cache) of ids [B, T] with T split over `axis`: float32 logits [B, T, vocab],
    equal to `model(input_ids)`."""
    return prefill_context_parallel(model, input_ids, mesh=mesh, axis=axis, layout=layout)
