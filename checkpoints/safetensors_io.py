"""Reading and writing safetensors without executing or unpickling anything.

The format is an 8-byte little-endian header length, a JSON header mapping tensor names to
`{dtype, shape, data_offsets}`, then the raw bytes. Files are memory-mapped and each tensor is a zero-copy
numpy view, so a loader touches one tensor at a time. bf16 and FP8 come from ml_dtypes.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}  # fmt: skip
_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint file or folder is malformed, incomplete or does not match the model."""


class SafetensorsFile:
    """One memory-mapped .safetensors file; validates the header against the file size on open."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        if size < 8:
            raise CheckpointError(f"{self.path}: {size} bytes, too short to be a safetensors file")
        with self.path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > min(MAX_HEADER, size - 8):
                raise CheckpointError(
                    f"{self.path}: header length {n} does not fit the file ({size} bytes); "
                    "truncated or not a safetensors file"
                )
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{self.path}: corrupted safetensors header ({e})") from None
        self.metadata = header.pop("__metadata__", {}) or {}
        self._data_start = 8 + n
        self._entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        data_len = size - self._data_start
        for name, info in header.items():
            try:
                dtype = DTYPES[info["dtype"]]
                shape = tuple(int(s) for s in info["shape"])
                start, end = (int(o) for o in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} has an unsupported or malformed entry {info}"
                ) from None
            if not 0 <= start <= end <= data_len or end - start != dtype.itemsize * int(np.prod(shape)):
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} spans bytes [{start}, {end}) which do not match "
                    f"its shape {shape} {info['dtype']} or the {data_len} data bytes; "
                    "the file is truncated or corrupted"
                )
            self._entries[name] = (dtype, shape, start, end)
        self._mmap: mmap.mmap | None = None

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def get(self, name: str) -> np.ndarray:
        """A read-only zero-copy view of one tensor."""
        dtype, shape, start, end = self._entries[name]
        if self._mmap is None:
            with self.path.open("rb") as f:
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = np.frombuffer(self._mmap, dtype=np.uint8, count=end - start, offset=self._data_start + start)
        return buf.view(dtype).reshape(shape)

    def release(self, name: str) -> None:
        """Drop the tensor's pages from this process's resident set once it has been copied elsewhere.
        The mapping is read-only and file-backed, so a later read simply faults the pages in again."""
        if self._mmap is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        _, _, start, end = self._entries[name]
        page = mmap.PAGESIZE
        lo = (self._data_start + start) // page * page
        hi = self._data_start + end
        if hi > lo:
            self._mmap.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


class CheckpointFolder(Mapping):
    """All tensors of a Hugging Face folder: `model.safetensors`, or the shards listed in
    `model.safetensors.index.json`, or every `*.safetensors` file. Maps name -> numpy view."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif (self.folder / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.folder}: no model.safetensors, index or *.safetensors file")
        self.files: dict[str, SafetensorsFile] = {}
        self._where: dict[str, str] = {}
        for fname in files:
            path = self.folder / fname
            if not path.is_file():
                raise CheckpointError(f"{self.folder}: shard {fname} listed in the index is missing")
            sf = SafetensorsFile(path)
            self.files[fname] = sf
            for k in sf.keys():
                self._where[k] = fname

    def __getitem__(self, name: str) -> np.ndarray:
        return self.files[self._where[name]].get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def release(self, name: str) -> None:
        self.files[self._where[name]].release(name)

    def file_of(self, name: str) -> str:
        return self._where.get(name, "<not in any file>")

    def shape(self, name: str) -> tuple[int, ...]:
        return self.files[self._where[name]].shape(name)


def write_safetensors(path: str | Path, tensors: Mapping[str, np.ndarray], metadata: dict | None = None) -> None:
    """Write tensors atomically (a temporary file in the same folder, then rename)."""
    path = Path(path)
    header: dict = {"__metadata__": {str(k): str(v) for k, v in (metadata or {}).items()}}
    offset = 0
    arrays = []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype not in _NAMES:
            raise CheckpointError(f"tensor {name!r}: dtype {arr.dtype} cannot be stored in safetensors")
        header[name] = {
            "dtype": _NAMES[arr.dtype],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep the data 8-byte aligned
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for arr in arrays:
                f.write(arr.tobytes())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
