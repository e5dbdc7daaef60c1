"""Device meshes with the project's named axes: dp (data), cp (context / sequence), tp (tensor), ep (experts)."""

from __future__ import annotations

import jax
from jax.sharding import AxisType, Mesh

AXES = ("dp", "cp", "tp", "ep")


def make_mesh(*, dp: int = 1, cp: int = 1, tp: int = 1, ep: int = 1, devices=None) -> Mesh:
    """A mesh over all (or the given) devices with axes (dp, cp, tp, ep); their product must be the device count.

    Axes are `Auto`: parameters and activations carry NamedShardings and XLA inserts the collectives, while
    the context-parallel pieces run as explicit `jax.shard_map` collectives over `cp`."""
    sizes = {"dp": dp, "cp": cp, "tp": tp, "ep": ep}
    for name, size in sizes.items():
        if size < 1:
            raise ValueError(f"make_mesh: {name}={size} must be >= 1")
    devices = list(jax.devices() if devices is None else devices)
    total = dp * cp * tp * ep
    if total != len(devices):
        raise ValueError(f"make_mesh: dp*cp*tp*ep = {dp}*{cp}*{tp}*{ep} = {total} != {len(devices)} devices")
    return jax.make_mesh(tuple(sizes.values()), AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)
