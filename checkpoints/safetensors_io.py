"""Reading and writing safetensors without executing or unpickling anything, and without trusting the folder.

The format is an 8-byte little-endian header length, a JSON header mapping tensor names to
`{dtype, shape, data_offsets}`, then the raw bytes. Every header is validated completely before any tensor is
read (see `SafetensorsFile`), and every file an index names must resolve inside the checkpoint folder
(`resolve_inside`). Files are memory-mapped and each tensor is a zero-copy numpy view, so a loader touches one
tensor at a time. bf16 and FP8 come from ml_dtypes.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import stat
import struct
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32), "U16": np.dtype(np.uint16), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}  # fmt: skip
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0"})
# Every dtype name of the safetensors format (0.8.0); the sub-byte, complex and FNUZ ones are valid but not loaded.
SPEC_DTYPES = frozenset(DTYPES) | {"F4", "F6_E2M3", "F6_E3M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "C64"}
_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100_000_000  # the safetensors library's limit
_FIELDS = ("dtype", "shape", "data_offsets")
INDEX = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint file or folder is malformed, incomplete or does not match the model."""


def resolve_folder(folder: str | Path) -> Path:
    """The checkpoint folder with every symlink resolved (the folder itself may be a link)."""
    try:
        root = Path(folder).resolve(strict=True)
    except FileNotFoundError:
        raise CheckpointError(f"{folder} is not a folder (it does not exist)") from None
    except (OSError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"{folder}: cannot open the checkpoint folder ({e})") from None
    if not root.is_dir():
        raise CheckpointError(f"{folder} is not a folder")
    return root


def _hf_cache_blob(root: Path, target: Path) -> bool:
    """The Hugging Face hub cache layout (`snapshot_download` without local_dir): every file of
    `models--org--name/snapshots/<rev>/` is a symlink to `models--org--name/blobs/<hash>`. Only that sibling
    `blobs` folder is accepted, and only when the folder sits exactly in that layout."""
    repo = root.parent.parent
    return root.parent.name == "snapshots" and repo.name.startswith("models--") and target.parent == repo / "blobs"


def resolve_inside(root: Path, name: object, what: str | None = None) -> Path:
    """`root / name` with every symlink resolved, which must lie inside the (resolved) checkpoint folder `root`.

    `name` comes from the folder (an index entry, a listed file); `what` names it in errors. A symlink whose
    target is inside the folder is fine; anything else (`..`, an absolute path, a link out) is a CheckpointError.
    """
    what = what or str(root / str(name))
    if not isinstance(name, str) or not name or "\0" in name:
        raise CheckpointError(f"{what}: not a file name")
    try:
        target = (root / name).resolve()
    except (OSError, RuntimeError, ValueError) as e:  # a symlink loop, a name too long
        raise CheckpointError(f"{what}: cannot resolve it ({e})") from None
    if not target.is_relative_to(root) and not _hf_cache_blob(root, target):
        raise CheckpointError(f"{what} resolves to {target}, outside the checkpoint folder {root}")
    return target


def regular_file(path: Path, what: str) -> Path:
    """`path` (already resolved) must be an existing regular file: not missing, a folder, a FIFO or a device."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{what}: {path} is missing") from None
    except OSError as e:
        raise CheckpointError(f"{what}: cannot read {path} ({e})") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{what}: {path} is not a file")
    return path


def read_json(path: Path, what: str | None = None) -> object:
    """A JSON file of the checkpoint; any decoding problem is a CheckpointError naming the file. Duplicate keys
    and NaN / Infinity (not JSON) are refused."""
    what = what or str(path)
    try:
        return json.loads(path.read_bytes().decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_nan)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, _JsonValueError) as e:
        raise CheckpointError(f"{what}: invalid JSON ({_one_line(e)})") from None
    except OSError as e:
        raise CheckpointError(f"{what}: cannot read it ({e})") from None


class _JsonValueError(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise _JsonValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _nan(token: str):
    raise _JsonValueError(f"{token} is not a JSON value")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _index_list(value: object, what: str) -> list[int]:
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise CheckpointError(f"{what} {json.dumps(value)[:80]} is not a list of non-negative integers")
    return value


class SafetensorsFile:
    """One memory-mapped .safetensors file, its header validated completely on open.

    Validated, as the format requires: header length within the file and at most 100 MB; the header a UTF-8
    JSON object starting with '{', without duplicate names; `__metadata__` a map of strings to strings; each
    tensor an object with a dtype among the format's names (one this loader supports), a shape of
    non-negative integers and two integer data_offsets whose span is exactly shape x dtype size; and the
    tensors, sorted by offset, contiguous from 0, non-overlapping and ending exactly at the end of the file.
    The `safetensors` library's own `safe_open` then opens the file as a second, independent check.

    Why a hand-written reader at all: `safe_open` does not expose the data offsets, its numpy tensors are
    copies (one per tensor, on top of the copy `device_put` makes) rather than views of the mapping we can
    `madvise` away, it cannot build F8_E8M0 arrays for numpy, and it accepts duplicate tensor names (the last
    one wins) and reports a truncated file only as "incomplete metadata". So the header is parsed here, with
    messages that name the file and field, and the library is used to validate only.
    """

    def __init__(self, path: str | Path, name: str | None = None):
        self.path = Path(path)
        self.name = name or self.path.name
        w = str(path)
        try:
            with self.path.open("rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    raise CheckpointError(f"{w}: not a regular file")
                size = st.st_size
                if size < 8:
                    raise CheckpointError(f"{w}: {size} bytes, too short to be a safetensors file")
                (n,) = struct.unpack("<Q", f.read(8))
                if n > MAX_HEADER:
                    raise CheckpointError(
                        f"{w}: header length {n} exceeds the format's limit of {MAX_HEADER} bytes; "
                        "not a safetensors file"
                    )
                if n > size - 8:
                    raise CheckpointError(
                        f"{w}: header length {n} does not fit the file ({size} bytes); "
                        "the file is truncated or not a safetensors file"
                    )
                raw = f.read(n)
        except OSError as e:
            raise CheckpointError(f"{w}: cannot read it ({e})") from None
        if len(raw) != n:
            raise CheckpointError(f"{w}: changed while it was being read")
        if not raw.startswith(b"{"):
            raise CheckpointError(f"{w}: the header does not start with '{{'; not a safetensors file")
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_nan)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, _JsonValueError) as e:
            raise CheckpointError(f"{w}: corrupted safetensors header, invalid JSON ({_one_line(e)})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{w}: the header is not a JSON object")
        meta = header.pop("__metadata__", None)
        if meta is not None and (not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values())):
            raise CheckpointError(f"{w}: __metadata__ is not a map of strings to strings")
        self.metadata: dict[str, str] = meta or {}
        self._size = size
        self._data_start = 8 + n
        data_len = size - self._data_start
        self._entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            self._entries[name] = self._entry(w, name, info)
        self._check_layout(w, data_len)
        # The reference implementation must agree. It checks everything above again; a disagreement would be a
        # bug here, so its message is passed on as it is, with the file named.
        try:
            with safe_open(str(self.path), framework="numpy"):
                pass
        except Exception as e:  # safetensors_rust.SafetensorError, OSError
            raise CheckpointError(f"{w}: refused by the safetensors library ({_one_line(e)})") from None
        self._mmap: mmap.mmap | None = None

    @staticmethod
    def _entry(w: str, name: str, info: object) -> tuple[str, tuple[int, ...], int, int]:
        where = f"{w}: tensor {name!r}"
        if not isinstance(info, dict):
            raise CheckpointError(f"{where} is {json.dumps(info)[:80]}, not an object with {', '.join(_FIELDS)}")
        missing = [k for k in _FIELDS if k not in info]  # other keys are ignored, as the library does
        if missing:
            raise CheckpointError(f"{where} lacks {', '.join(missing)}")
        dtype = info["dtype"]
        if not isinstance(dtype, str) or dtype not in SPEC_DTYPES:
            raise CheckpointError(
                f"{where} dtype {dtype!r} is not a safetensors dtype (one of {', '.join(sorted(SPEC_DTYPES))})"
            )
        if dtype not in DTYPES:
            raise CheckpointError(
                f"{where} dtype {dtype!r} is not supported by this loader (supported: {', '.join(sorted(DTYPES))})"
            )
        shape = _index_list(info["shape"], f"{where} shape")
        offsets = _index_list(info["data_offsets"], f"{where} data_offsets")
        if len(offsets) != 2 or offsets[0] > offsets[1]:
            raise CheckpointError(f"{where} data_offsets {offsets} are not [begin, end] with begin <= end")
        begin, end = offsets
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        if any(s >= 2**62 for s in shape) or math.prod(max(s, 1) for s in shape) >= 2**62:
            raise CheckpointError(f"{where} shape {shape} is too large")
        if end - begin != nbytes:
            raise CheckpointError(
                f"{where} data_offsets [{begin}, {end}] span {end - begin} bytes, but its shape {tuple(shape)} "
                f"{dtype} needs {nbytes} bytes"
            )
        return dtype, tuple(shape), begin, end

    def _check_layout(self, w: str, data_len: int) -> None:
        """Tensors sorted by offset must tile the data region exactly: from 0, no overlap, no gap, to the end."""
        spans = sorted((b, e, name) for name, (_, _, b, e) in self._entries.items())
        last = max(spans, key=lambda s: s[1], default=(0, 0, ""))
        if last[1] > data_len:
            raise CheckpointError(
                f"{w}: the file is shorter than its header promises: tensor {last[2]!r} ends at data byte "
                f"{last[1]}, but the file holds {data_len} data bytes (truncated download?)"
            )
        pos, prev = 0, None
        for b, e, name in spans:
            if b < pos:
                pb, pe = self._entries[prev][2:]
                raise CheckpointError(
                    f"{w}: tensor {name!r} data_offsets [{b}, {e}] overlap tensor {prev!r} [{pb}, {pe}]"
                )
            if b > pos:
                raise CheckpointError(
                    f"{w}: tensor {name!r} data_offsets [{b}, {e}] leave data bytes [{pos}, {b}) unused; "
                    "tensors must be contiguous"
                )
            if e > b:
                pos, prev = e, name
        if pos != data_len:
            raise CheckpointError(
                f"{w}: {data_len - pos} bytes after the last tensor (the tensors end at data byte {pos}, the "
                f"file holds {data_len}); the data must be covered exactly"
            )

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def dtype_name(self, name: str) -> str:
        return self._entries[name][0]

    def get(self, name: str) -> np.ndarray:
        """A read-only zero-copy view of one tensor."""
        dtype, shape, start, end = self._entries[name]
        if end == start:
            return np.zeros(shape, DTYPES[dtype])
        if self._mmap is None:
            with self.path.open("rb") as f:
                if os.fstat(f.fileno()).st_size != self._size:
                    raise CheckpointError(f"{self.path}: changed size since its header was validated")
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = np.frombuffer(self._mmap, dtype=np.uint8, count=end - start, offset=self._data_start + start)
        return buf.view(DTYPES[dtype]).reshape(shape)

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
    """All tensors of a Hugging Face folder: the shards listed in `model.safetensors.index.json`, or
    `model.safetensors`, or every `*.safetensors` file. Maps name -> numpy view.

    Every file resolves inside the folder (symlinks followed only to targets inside it); every index entry is
    a file name whose file holds that tensor; no tensor is in two files."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.root = resolve_folder(folder)
        index = self.root / INDEX
        listed: dict[Path, str] = {}  # resolved path -> name for messages
        claims: list[tuple[str, str, Path]] = []  # (tensor, what, resolved path) from the index
        if index.exists() or index.is_symlink():
            index = regular_file(resolve_inside(self.root, INDEX), str(index))
            doc = read_json(index, str(self.root / INDEX))
            if not isinstance(doc, dict) or "weight_map" not in doc:
                raise CheckpointError(f"{self.root / INDEX}: no 'weight_map' object")
            weight_map = doc["weight_map"]
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{self.root / INDEX}: weight_map is not an object of tensor -> file name")
            for tensor, fname in weight_map.items():
                what = f"{self.root / INDEX}: weight_map[{tensor!r}] = {fname!r}"
                path = regular_file(resolve_inside(self.root, fname, what), what)
                listed.setdefault(path, fname)
                claims.append((tensor, what, path))
        else:
            single = self.root / "model.safetensors"
            if single.exists() or single.is_symlink():
                names = ["model.safetensors"]
            else:
                names = sorted(p.name for p in self.root.glob("*.safetensors"))
            for fname in names:
                listed.setdefault(regular_file(resolve_inside(self.root, fname), str(self.root / fname)), fname)
        if not listed:
            raise CheckpointError(f"{self.folder}: no model.safetensors, index or *.safetensors file")
        self.files: dict[str, SafetensorsFile] = {}
        self._where: dict[str, str] = {}
        for path, fname in sorted(listed.items(), key=lambda kv: kv[1]):
            sf = SafetensorsFile(path, fname)
            self.files[fname] = sf
            for k in sf.keys():
                if k in self._where:
                    raise CheckpointError(f"{self.folder}: tensor {k!r} is in both {self._where[k]} and {fname}")
                self._where[k] = fname
        for tensor, what, path in claims:
            if self._where.get(tensor) != listed[path]:
                raise CheckpointError(f"{what}: tensor {tensor!r} is not in that file")

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

    def path_of(self, name: str) -> str:
        """The full path of the file holding `name`, for messages."""
        return str(self.root / self._where[name]) if name in self._where else f"<not in any file of {self.root}>"

    def shape(self, name: str) -> tuple[int, ...]:
        return self.files[self._where[name]].shape(name)

    def dtype_name(self, name: str) -> str:
        """The tensor's safetensors dtype name (F32, BF16, I32, ...)."""
        return self.files[self._where[name]].dtype_name(name)


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
