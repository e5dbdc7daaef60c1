"""Hierarchical quantization config: how much each module is quantized follows its sensitivity.

    indexer:    {dtype: mxfp8, granularity: per-group, group_size: 32}            # only picks positions
    kv_cache:   {dtype: fp8, granularity: per-token-head-tile, tile_size: 128}    # read-heavy, stored FP8
    projection: {dtype: bf16}                                                      # feeds the residual path

Each part can be switched off (`dtype: none`, or leave the key out) independently.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax.numpy as jnp


def _fail(part: str, field: str, value: Any, allowed) -> None:
    raise ValueError(f"QuantConfig.{part}.{field}={value!r}: expected one of {allowed}")


@dataclasses.dataclass(frozen=True)
class IndexerQuant:
    dtype: str = "mxfp8"
    granularity: str = "per-group"
    group_size: int = 32

    def __post_init__(self):
        if self.dtype not in ("mxfp8", "none"):
            _fail("indexer", "dtype", self.dtype, ("mxfp8", "none"))
        if self.granularity != "per-group":
            _fail("indexer", "granularity", self.granularity, ("per-group",))
        if self.group_size != 32:
            _fail("indexer", "group_size", self.group_size, (32,))  # fixed by the OCP MX spec

    @property
    def enabled(self) -> bool:
        return self.dtype == "mxfp8"


@dataclasses.dataclass(frozen=True)
class KVCacheQuant:
    dtype: str = "fp8"
    granularity: str = "per-token-head-tile"
    tile_size: int = 128

    def __post_init__(self):
        if self.dtype not in ("fp8", "none"):
            _fail("kv_cache", "dtype", self.dtype, ("fp8", "none"))
        if self.granularity != "per-token-head-tile":
            _fail("kv_cache", "granularity", self.granularity, ("per-token-head-tile",))
        if self.tile_size <= 0:
            raise ValueError(f"QuantConfig.kv_cache.tile_size={self.tile_size!r}: must be positive")

    @property
    def enabled(self) -> bool:
        return self.dtype == "fp8"


@dataclasses.dataclass(frozen=True)
class ProjectionQuant:
    dtype: str = "bf16"

    def __post_init__(self):
        if self.dtype not in ("bf16", "fp32", "fp8", "none"):
            _fail("projection", "dtype", self.dtype, ("bf16", "fp32", "fp8", "none"))

    @property
    def param_dtype(self):
        """Dtype of the non-projection weights (and of the projections unless FP8); None = the model's own."""
        return {"bf16": jnp.bfloat16, "fp32": jnp.float32, "fp8": jnp.bfloat16}.get(self.dtype)

    @property
    def fp8_weights(self) -> bool:
        """FP8-resident projections: E4M3 kernels with 128 x 128 float32 block scales (DeepSeek's format)."""
        return self.dtype == "fp8"


_PARTS = {"indexer": IndexerQuant, "kv_cache": KVCacheQuant, "projection": ProjectionQuant}


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    indexer: IndexerQuant = dataclasses.field(default_factory=lambda: IndexerQuant("none"))
    kv_cache: KVCacheQuant = dataclasses.field(default_factory=lambda: KVCacheQuant("none"))
    projection: ProjectionQuant = dataclasses.field(default_factory=lambda: ProjectionQuant("none"))

    @classmethod
    def hierarchical(cls) -> QuantConfig:
        """Quantization by sensitivity (docs/quantization.md): MXFP8 indexer, FP8 KV cache, BF16 projections."""
        return cls(IndexerQuant(), KVCacheQuant(), ProjectionQuant())

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> QuantConfig:
        d = d or {}
        unknown = sorted(set(d) - set(_PARTS))
        if unknown:
            raise ValueError(f"QuantConfig: unknown part(s) {unknown}; expected {sorted(_PARTS)}")
        parts = {}
        for name, klass in _PARTS.items():
            sub = d.get(name)
            if sub is None:
                continue
            if not isinstance(sub, dict):
                raise ValueError(f"QuantConfig.{name}={sub!r}: expected a mapping")
            fields = {f.name for f in dataclasses.fields(klass)}
            extra = sorted(set(sub) - fields)
            if extra:
                raise ValueError(f"QuantConfig.{name}: unknown field(s) {extra}; expected {sorted(fields)}")
            parts[name] = klass(**{k: (str(v).lower() if k == "dtype" else v) for k, v in sub.items()})
        return cls(**parts)

    @classmethod
    def from_yaml(cls, path: str | Path) -> QuantConfig:
        import yaml

        return cls.from_dict(yaml.safe_load(Path(path).read_text()))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
