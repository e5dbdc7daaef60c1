"""The one table from logical axis names to mesh axes.

Parameters carry `logical_axes` metadata (e.g. `("embed", "heads")`); nothing in the model names a mesh
axis. A logical name maps to one mesh axis, a tuple of mesh axes, or None (replicated). Mesh axes that the
current mesh lacks are dropped, so the same table serves a 1-device run and a (dp, cp, tp, ep) mesh.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None

LOGICAL_AXIS_RULES: dict[str, MeshAxes] = {
    # parameters
    "vocab": "tp",  # embedding rows and LM-head columns
    "embed": None,  # the model dimension stays whole: activations are sequence-parallel instead
    "heads": "tp",  # MLA query / output heads (flattened heads x head_dim)
    "kda_heads": "tp",  # KDA heads (q/k/v/gates, conv channels, A_log, dt_bias)
    "kv_heads": "tp",  # gated GQA key / value heads (flattened kv heads x head_dim)
    "index_heads": "tp",  # lightning-indexer heads
    "q_lora": None,
    "kv_lora": None,  # the compressed latent is shared by all heads
    "mlp": "tp",  # dense SwiGLU hidden
    "expert": "ep",
    "expert_mlp": "tp",
    "norm": None,
    # activations
    "batch": "dp",
    "seq": "cp",  # token ids and positions entering a context-parallel prefill
    # The residual stream between layers: split over cp (context parallel) and, inside each TP group, over tp
    # as well (sequence parallelism), so norms, residual adds and AttnRes mixes touch T / (cp * tp) tokens
    # and the TP matmuls all-gather their input and reduce-scatter their output along the sequence.
    "act_seq": ("cp", "tp"),
}


def logical_to_spec(
    logical_axes: Sequence[str | None],
    rules: Mapping[str, MeshAxes] = LOGICAL_AXIS_RULES,
    mesh_axis_names: Sequence[str] | None = None,
) -> PartitionSpec:
    """Map per-dimension logical names to a PartitionSpec; each mesh axis is used at most once."""
    used: set[str] = set()
    out: list[MeshAxes] = []
    for name in logical_axes:
        if name is None:
            out.append(None)
            continue
        if name not in rules:
            raise ValueError(f"logical axis {name!r} has no rule; known: {sorted(rules)}")
        target = rules[name]
        axes = () if target is None else (target,) if isinstance(target, str) else tuple(target)
        if mesh_axis_names is not None:
            axes = tuple(a for a in axes if a in mesh_axis_names)
        for a in axes:
            if a in used:
                raise ValueError(f"mesh axis {a!r} would shard two dimensions of {tuple(logical_axes)}")
            used.add(a)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*out)


def _fit(spec: PartitionSpec, shape: Sequence[int], sizes: Mapping[str, int], skip=()) -> PartitionSpec:
    """Drop mesh axes from dimensions they do not divide evenly (or that are in `skip`)."""
    fitted = []
    for size, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)), strict=True):
        names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        names = tuple(a for a in names if a not in skip)
        ways = math.prod(sizes[a] for a in names)
        fitted.append(None if not names or size % ways else names[0] if len(names) == 1 else names)
    return PartitionSpec(*fitted)


def constrain(x: jax.Array, logical_axes: Sequence[str | None], rules: Mapping[str, MeshAxes] = LOGICAL_AXIS_RULES):
    """Sharding constraint on an activation, by logical axis names, against the mesh set with
    `jax.set_mesh` (a no-op without one). Manual axes (inside `jax.shard_map`) and axes that do not divide a
    dimension (a one-token decode step over tp) are left out, so the same model code runs everywhere."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    manual = {n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == AxisType.Manual}
    spec = _fit(logical_to_spec(logical_axes, rules, mesh.axis_names), x.shape, dict(mesh.shape), manual)
    return jax.lax.with_sharding_constraint(x, spec)


def param_sharding(var: nnx.Variable, mesh: Mesh, rules: Mapping[str, MeshAxes] = LOGICAL_AXIS_RULES) -> NamedSharding:
    """NamedSharding of one parameter from its logical axes. A dimension that the mesh axes do not divide
    evenly (e.g. 2 KDA heads over tp=8) stays whole on every device instead of being split unevenly."""
    spec = logical_to_spec(var.get_metadata()["logical_axes"], rules, mesh.axis_names)
    return NamedSharding(mesh, _fit(spec, var.get_value().shape, dict(mesh.shape)))


def shard_params(model: nnx.Module, mesh: Mesh, rules: Mapping[str, MeshAxes] = LOGICAL_AXIS_RULES) -> nnx.Module:
    """Place every parameter of `model` on its rule-given NamedSharding (in place); returns the model."""
    state = nnx.state(model, nnx.Param)

    def place(_, var):
        sharding = param_sharding(var, mesh, rules)
        value = var.get_value()
        if sharding.is_fully_addressable:
            return jax.device_put(value, sharding)
        # Multi-process: every process holds the same host value and contributes its own shards.
        host = np.asarray(value)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    nnx.update(model, nnx.map_state(place, state))
    return model


def param_partition_specs(
    model: nnx.Module, rules: Mapping[str, MeshAxes] = LOGICAL_AXIS_RULES, mesh_axis_names: Sequence[str] | None = None
) -> nnx.State:
    """A State with the structure of the model's parameters whose leaves are PartitionSpecs."""
    state = nnx.state(model, nnx.Param)

    def spec(var):
        axes = var.get_metadata().get("logical_axes")
        if axes is None:
            raise ValueError(f"parameter of shape {var.get_value().shape} carries no logical_axes metadata")
        return logical_to_spec(axes, rules, mesh_axis_names)

    return nnx.map_state(lambda _, v: spec(v), state)
