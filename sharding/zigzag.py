"""Zigzag sequence layout for causal context parallelism.

The sequence is cut into 2*cp equal chunks; device i holds chunks i and 2*cp-1-i, so every device gets one
early (cheap) and one late (expensive) chunk of causal work. Positions travel with the tokens; outputs are
put back in order with `from_zigzag`. The sequential split (device i holds chunk i of cp) is the baseline.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def piece_table(cp: int, layout: str) -> np.ndarray:
    """[cp, pieces per device] global index of each piece a device holds (pieces are equal slices in order)."""
    if layout == "sequential":
        return np.arange(cp)[:, None]
    if layout == "zigzag":
        return np.stack([np.arange(cp), 2 * cp - 1 - np.arange(cp)], axis=1)
    raise ValueError(f"unknown layout {layout!r}; expected 'sequential' or 'zigzag'")


def layout_order(t: int, cp: int, layout: str = "zigzag") -> np.ndarray:
    """Positions in device-major order: device i's tokens are order[i * t/cp : (i+1) * t/cp]."""
    table = piece_table(cp, layout)
    pieces = table.size
    if t % pieces:
        raise ValueError(f"sequence length {t} is not a multiple of {pieces} ({layout} layout over cp={cp})")
    c = t // pieces
    return (table.reshape(-1)[:, None] * c + np.arange(c)[None, :]).reshape(-1)


def to_zigzag(x, cp: int, axis: int = 1):
    return jnp.take(x, jnp.asarray(layout_order(x.shape[axis], cp, "zigzag")), axis=axis)


def from_zigzag(x, cp: int, axis: int = 1):
    return jnp.take(x, jnp.asarray(np.argsort(layout_order(x.shape[axis], cp, "zigzag"))), axis=axis)


def causal_work(t: int, cp: int, layout: str) -> np.ndarray:
    """Query-key pairs each device scores in a causal layer (query at position p sees p + 1 keys)."""
    order = layout_order(t, cp, layout).reshape(cp, -1)
    return (order + 1).sum(axis=1)
