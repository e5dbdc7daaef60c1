"""Looking inside a forward pass: record what the lightning indexers select and where the MoE routers send
each token.

    with record_indexer() as records:
        model(ids)          # eagerly, not under jit
    records[0]["indices"]   # [B, T, topk] positions chosen by the first sparse layer (-1 = none)

Each record is a dict with the indexer's inputs to the Top-K: `q` [B, T, N_I, H_I] (rotated; the
quantize-dequantize image when the indexer runs in MXFP8), `k` [B, S, H_I] keys in position order as read
from the cache, `weights` [B, T, N_I] (already scaled by N_I^-1/2), `scale`, `positions` [B, T] and the
chosen `indices`; the sparse MLA layer adds `attention` [B, N, T, S], the probabilities dense attention would
give every earlier position (to measure how much of that mass the Top-K keeps). Records come in call order,
i.e. the model's sparse layers in order.

KPool indexer (`index_kpool` = P > 1): `k` holds the pooled keys [B, S / P, H_I], `positions` the last pool each
query may read (⌊(t+1)/P⌋ − 1), `indices` the chosen pools, `pool_size` P and `token_indices` [B, T, topk + P − 1]
the token positions read (the chosen pools' tokens, then the query's incomplete pool). A layer that shares
another's selection records only `indices` (token positions), `positions` and `shared=True`, plus `attention`.

    with record_router() as routes:
        model(ids)
    routes[0]["indices"]    # [B*T, experts per token] routed experts of each token in the first MoE layer

One record per MoE layer call, in call order: `indices` [B*T, k] int32 and `weights` [B*T, k] float32 (the
routing weights the experts' outputs are summed with, after `routed_scaling_factor`), tokens flattened in
(batch, time) order. An MTP head's MoE (`mtp_extend`) records too, after the model's layers.

Recording is a context-local switch read while tracing: code outside the `with` block (and every jitted
function) is unchanged. Under `jax.jit` the values would be tracers, so recording refuses them — unless the
block is entered with `traced=True` *inside* the traced function: then the records hold the traced arrays
themselves, for that function to compute with (the indexer's distillation loss in `scripts/train_recall.py`,
the experts a decode step touches in `benchmarks/common.decode_loop`); they must not leave the trace, nor the
body of a loop (`lax.fori_loop`, `while_loop`) they were recorded in. A function jitted before the block and
called inside it reuses its trace and records nothing.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
import numpy as np

_RECORDS: contextvars.ContextVar[list | None] = contextvars.ContextVar("hybrid_jax_indexer_records", default=None)
_TRACED: contextvars.ContextVar[bool] = contextvars.ContextVar("hybrid_jax_indexer_traced", default=False)
_ROUTES: contextvars.ContextVar[list | None] = contextvars.ContextVar("hybrid_jax_router_records", default=None)
_ROUTES_TRACED: contextvars.ContextVar[bool] = contextvars.ContextVar("hybrid_jax_router_traced", default=False)


@contextlib.contextmanager
def _recording(records_var, traced_var, traced: bool):
    records: list[dict] = []
    token, mode = records_var.set(records), traced_var.set(traced)
    try:
        yield records
    finally:
        records_var.reset(token)
        traced_var.reset(mode)


def record_indexer(*, traced: bool = False):
    """Collect one record per sparse-layer call made inside the block (in call order). `traced=True`: keep the
    values as JAX arrays (tracers under jit) instead of copying them to NumPy."""
    return _recording(_RECORDS, _TRACED, traced)


def record_router(*, traced: bool = False):
    """Collect one record per MoE-layer call made inside the block (in call order): the routed experts
    `indices` and their `weights`, [B*T, k] each. `traced=True`: keep them as JAX arrays (tracers under jit)."""
    return _recording(_ROUTES, _ROUTES_TRACED, traced)


def recording() -> bool:
    return _RECORDS.get() is not None


def _append(records_var, traced_var, name: str, values: dict) -> None:
    records = records_var.get()
    if records is None:
        return
    if traced_var.get():
        records.append(dict(values))
        return
    if any(isinstance(v, jax.core.Tracer) for v in jax.tree_util.tree_leaves(values)):
        raise RuntimeError(
            f"{name}() records eager calls only: call the model outside jax.jit (generate and the other "
            f"compiled loops trace it), or enter {name}(traced=True) inside the traced function"
        )
    records.append({k: np.asarray(v) if isinstance(v, jax.Array) else v for k, v in values.items()})


def add_record(**values) -> None:
    """A sparse layer's record (`record_indexer`); nothing outside such a block."""
    _append(_RECORDS, _TRACED, "record_indexer", values)


def add_route(**values) -> None:
    """An MoE layer's routing (`record_router`); nothing outside such a block."""
    _append(_ROUTES, _ROUTES_TRACED, "record_router", values)


def attach(**values) -> None:
    """Add values to the newest record (the sparse MLA layer adds its dense attention probabilities)."""
    records = _RECORDS.get()
    if records:
        add_record(**values)
        records[-2].update(records.pop())


def head_scores(record: dict) -> np.ndarray:
    """Per-head indexer scores w_h(t) * ReLU(scale * q_h(t) . k(s)), causal: [B, N_I, T, S] float32 (-inf where
    s > t). Their sum over heads is the score that the Top-K ranks."""
    q = jnp.asarray(record["q"], jnp.float32)
    k = jnp.asarray(record["k"], jnp.float32)
    w = jnp.asarray(record["weights"], jnp.float32)
    s = jnp.einsum("btnh,bsh->bnts", q, k) * record["scale"]
    s = jax.nn.relu(s) * jnp.moveaxis(w, 2, 1)[..., None]
    pos = jnp.asarray(record["positions"])  # [B, T]
    causal = jnp.arange(k.shape[1])[None, None, None, :] <= pos[:, None, :, None]
    return np.asarray(jnp.where(causal, s, -jnp.inf))
