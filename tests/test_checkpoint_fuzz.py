"""Fuzzing the checkpoint loader (issue 43): a folder is never trusted.

A small valid checkpoint (the tiny model in our `hybrid` format, split into two shards with an index) is mutated
at random: safetensors header bytes, length prefix, truncation, header fields (dtype, shape, data_offsets,
names, metadata), the index (paths inside and outside the folder, names, structure), config.json, and symlinks.
Every mutated folder must either be refused with a one-line CheckpointError / ValueError that names the file,
or load a model equal to what the `safetensors` library itself decodes from it. Nothing outside the folder is
ever opened (decoys sit next to it, one a valid copy of a shard), and no example may hang.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import json
import os
import re
import shutil
import signal
import struct
import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.numpy import save_file

import checkpoints.safetensors_io as sio
from checkpoints import CheckpointError, from_pretrained, save_pretrained
from checkpoints.hf import abstract_model
from hybrid_jax import HybridConfig

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
INDEX = "model.safetensors.index.json"
DECOY = "outside.safetensors"  # a valid copy of shard 1, next to the folder
DECOY_JSON = "outside.json"  # a copy of config.json, next to the folder
TIMEOUT_S = 60  # per example; a hang fails the test
# CI runs a fixed, bounded set of examples; CHECKPOINT_FUZZ_EXAMPLES=N runs N fresh random ones instead.
_DEEP = int(os.environ.get("CHECKPOINT_FUZZ_EXAMPLES", "0"))
FUZZ = settings(
    max_examples=_DEEP or 60,
    deadline=None,
    derandomize=not _DEEP,  # the same examples on every run
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
# The dtype names of the safetensors format (0.8.0), written out here rather than taken from the code under test.
SPEC_DTYPES = (
    "BOOL F4 F6_E2M3 F6_E3M2 U8 I8 F8_E5M2 F8_E4M3 F8_E8M0 F8_E4M3FNUZ F8_E5M2FNUZ I16 U16 F16 BF16 I32 U32 F32 C64 "
    "F64 I64 U64"
).split()


# ---------------------------------------------------------------- the valid checkpoint


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """The tiny model (random float32 weights), saved, then split into two shards plus an index."""
    cfg = HybridConfig.tiny()
    graphdef, state = nnx.split(abstract_model(cfg, jnp.float32))
    rng = np.random.default_rng(0)
    for _, var in nnx.to_flat_state(state):
        value = var.get_value()
        var.set_value(jnp.asarray(rng.standard_normal(value.shape).astype(value.dtype)))
    d = tmp_path_factory.mktemp("fuzz") / "ckpt"
    save_pretrained(nnx.merge(graphdef, state), d)
    with safe_open(d / "model.safetensors", framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    names = sorted(tensors)
    weight_map = {}
    for shard, part in zip(SHARDS, (names[: len(names) // 2], names[len(names) // 2 :]), strict=True):
        save_file({k: tensors[k] for k in part}, d / shard)
        weight_map.update(dict.fromkeys(part, shard))
    (d / "model.safetensors").unlink()
    (d / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    return d


class Original(tuple):
    """(config, {path: array}) of the unmutated checkpoint, with a short repr for hypothesis' reports."""

    def __repr__(self) -> str:
        return "<original tiny checkpoint>"


@pytest.fixture(scope="module")
def original(pristine):
    model = from_pretrained(pristine, dtype=jnp.float32, progress=False)
    return Original((model.config, _params(model)))


def _params(model) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


# ---------------------------------------------------------------- mutations


def _read(path: Path) -> tuple[int, bytes, bytes]:
    b = path.read_bytes()
    (n,) = struct.unpack("<Q", b[:8])
    return n, b[8 : 8 + n], b[8 + n :]


def _header_bytes(data, d: Path) -> str:
    path = d / data.draw(st.sampled_from(SHARDS))
    b = bytearray(path.read_bytes())
    if not b:
        return "header bytes: skipped, empty file"
    n = min(struct.unpack("<Q", b[:8])[0], len(b) - 8) if len(b) >= 8 else len(b) - 8
    for _ in range(data.draw(st.integers(1, 4))):
        b[data.draw(st.integers(0, 8 + n - 1))] = data.draw(st.integers(0, 255))
    path.write_bytes(bytes(b))
    return "header bytes"


def _length_prefix(data, d: Path) -> str:
    path = d / data.draw(st.sampled_from(SHARDS))
    if path.stat().st_size < 8:
        return "length prefix: skipped, too short"
    n, head, body = _read(path)
    size = 8 + n + len(body)
    new = data.draw(
        st.one_of(
            st.integers(n - 16, n + 16).filter(lambda v: v != n and 0 <= v < 2**64),
            st.sampled_from([0, 1, 2, size - 8, size, 100_000_000, 100_000_001, 2**63, 2**64 - 1]),
        )
    )
    path.write_bytes(struct.pack("<Q", new) + head + body)
    return f"length prefix {new}"


def _truncate_or_extend(data, d: Path) -> str:
    path = d / data.draw(st.sampled_from(SHARDS))
    b = path.read_bytes()
    if b and data.draw(st.booleans()):
        cut = data.draw(st.integers(0, len(b) - 1))
        path.write_bytes(b[:cut])
        return f"truncated at {cut}"
    path.write_bytes(b + data.draw(st.binary(min_size=1, max_size=64)))
    return "extended"


JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**65), 2**65),
    st.sampled_from([0, 1, -1, 2, 64, 2**31, 2**63]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c), max_leaves=8
)


def _mutate_shape(data, shape: list) -> object:
    kind = data.draw(st.sampled_from(["permute", "bump", "append1", "drop", "replace", "scale", "any"]))
    shape = list(shape)
    if kind == "permute":
        return data.draw(st.permutations(shape))
    if kind == "bump" and shape:
        i = data.draw(st.integers(0, len(shape) - 1))
        shape[i] += data.draw(st.sampled_from([-1, 1]))
    elif kind == "append1":
        shape.insert(data.draw(st.integers(0, len(shape))), 1)
    elif kind == "drop" and shape:
        shape.pop(data.draw(st.integers(0, len(shape) - 1)))
    elif kind == "replace" and shape:
        shape[data.draw(st.integers(0, len(shape) - 1))] = data.draw(JSON_SCALARS)
    elif kind == "scale" and len(shape) >= 2:  # same element count, another split: [a, b] -> [a*b/2, 2] ...
        total = int(np.prod(shape))
        return [total // 2, 2] if total % 2 == 0 else [total, 1]
    elif kind == "any":
        return data.draw(JSON_VALUES)
    return shape


def _mutate_offsets(data, info: dict, entries: dict) -> object:
    b, e = info["data_offsets"]
    kind = data.draw(st.sampled_from(["other", "shift", "empty", "swap_ends", "grow", "any", "three"]))
    if kind == "other":  # another tensor's bytes (the overlap)
        other = data.draw(st.sampled_from(sorted(entries)))
        return list(entries[other]["data_offsets"])
    if kind == "shift":
        delta = data.draw(st.sampled_from([-8, -4, -1, 1, 4, 8, 2**40]))
        return [b + delta, e + delta]
    if kind == "empty":
        return [b, b]
    if kind == "swap_ends":
        return [e, b]
    if kind == "grow":
        return [b, e + data.draw(st.sampled_from([1, 4, 8]))]
    if kind == "three":
        return [b, e, e]
    return data.draw(JSON_VALUES)


def _header_field(data, d: Path) -> str:
    """Re-encode a header with one field changed (the length prefix is recomputed: only the field is wrong)."""
    path = d / data.draw(st.sampled_from(SHARDS))
    try:  # an earlier mutation may have broken it already
        n, head, body = _read(path)
        header = json.loads(head)
        entries = {k: v for k, v in header.items() if k != "__metadata__"}
        assert entries and all(isinstance(v, dict) and "data_offsets" in v for v in entries.values())
    except Exception:
        return "header field: skipped, not parseable"
    name = data.draw(st.sampled_from(sorted(entries)))
    field = data.draw(
        st.sampled_from(["dtype", "shape", "data_offsets", "swap", "rename", "delete", "add", "metadata", "dup"])
    )
    text = None
    if field == "dtype":
        entries[name]["dtype"] = data.draw(st.one_of(st.sampled_from(SPEC_DTYPES + ["f32", "F33", ""]), JSON_VALUES))
    elif field == "shape":
        entries[name]["shape"] = _mutate_shape(data, entries[name]["shape"])
    elif field == "data_offsets":
        entries[name]["data_offsets"] = _mutate_offsets(data, entries[name], entries)
    elif field == "swap":  # exchange two tensors' bytes: a valid file with other content
        other = data.draw(st.sampled_from(sorted(entries)))
        for k in ("dtype", "shape", "data_offsets"):
            entries[name][k], entries[other][k] = entries[other][k], entries[name][k]
    elif field == "rename":
        new = data.draw(st.one_of(st.sampled_from(sorted(entries)), st.text(max_size=20), st.just(name + "x")))
        entries = {(new if k == name else k): v for k, v in entries.items()}
    elif field == "delete":
        del entries[name]
    elif field == "add":
        entries[data.draw(st.text(max_size=20))] = data.draw(JSON_VALUES)
    elif field == "metadata":
        header["__metadata__"] = data.draw(JSON_VALUES)
    if field == "dup":  # a second entry of the same name
        text = json.dumps(header)
        text = text[:-1] + f", {json.dumps(name)}: {json.dumps(entries[name])}}}"
    else:
        meta = {"__metadata__": header["__metadata__"]} if "__metadata__" in header else {}
        text = json.dumps({**meta, **entries})
    blob = text.encode()
    if data.draw(st.booleans()):
        blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + body)
    return f"header {field} of {name!r}"


def _index(data, d: Path) -> str:
    path = d / INDEX
    try:
        index = json.loads(path.read_text())
        wm = index["weight_map"]
        assert isinstance(wm, dict) and wm
        key = data.draw(st.sampled_from(sorted(wm)))
    except Exception:
        return "index: skipped, not parseable"
    kind = data.draw(st.sampled_from(["value", "value", "value", "rename", "delete_key", "add_key", "structure"]))
    if kind == "value":
        choice = data.draw(
            st.sampled_from(
                [
                    f"../{DECOY}",
                    str(d.parent / DECOY),
                    f"sub/../../{DECOY}",
                    "link-out.safetensors",
                    f"./{SHARDS[0]}",
                    f"{d.name}/../{d.name}/{SHARDS[1]}",
                    SHARDS[0],
                    SHARDS[1],
                    "missing.safetensors",
                    "",
                    ".",
                    "..",
                    "/",
                    INDEX,
                    "config.json",
                    "JSON",
                ]
            )
        )
        if choice == "link-out.safetensors" and not (d / choice).is_symlink():
            (d / choice).symlink_to(d.parent / DECOY)
        wm[key] = data.draw(JSON_VALUES) if choice == "JSON" else choice
    elif kind == "rename":
        wm[data.draw(st.text(max_size=20))] = wm.pop(key)
    elif kind == "delete_key":
        del wm[key]
    elif kind == "add_key":
        wm[data.draw(st.text(max_size=20))] = data.draw(st.sampled_from(SHARDS))
    else:
        target = data.draw(st.sampled_from(["weight_map", "root", "text"]))
        if target == "weight_map":
            index["weight_map"] = data.draw(JSON_VALUES)
        elif target == "root":
            index = data.draw(JSON_VALUES)
        else:
            path.write_bytes(data.draw(st.binary(max_size=40)))
            return "index bytes"
    path.write_text(json.dumps(index))
    return f"index {kind} {key!r}"


def _config(data, d: Path) -> str:
    path = d / "config.json"
    try:
        cfg = json.loads(path.read_text())
        assert isinstance(cfg, dict) and cfg
        key = data.draw(st.sampled_from(sorted(cfg)))
    except Exception:
        return "config: skipped, not parseable"
    kind = data.draw(st.sampled_from(["value", "value", "nudge", "delete", "add", "text", "link"]))
    if kind == "value":
        cfg[key] = data.draw(JSON_VALUES)
    elif kind == "nudge" and type(cfg[key]) in (int, float):
        cfg[key] = cfg[key] + data.draw(st.sampled_from([-1, 1, 0.5]))
    elif kind == "nudge" and isinstance(cfg[key], list) and cfg[key]:
        cfg[key] = cfg[key][:-1] if data.draw(st.booleans()) else cfg[key] + cfg[key][-1:]
    elif kind == "delete":
        del cfg[key]
    elif kind == "add":
        cfg[data.draw(st.text(max_size=12))] = data.draw(JSON_VALUES)
    elif kind == "text":
        path.write_bytes(data.draw(st.binary(max_size=40)))
        return "config bytes"
    elif kind == "link":
        path.unlink()
        path.symlink_to(d.parent / DECOY_JSON)
        return "config link out"
    path.write_text(json.dumps(cfg))
    return f"config {kind} {key!r}"


def _links(data, d: Path) -> str:
    shard = d / data.draw(st.sampled_from(SHARDS))
    kind = data.draw(st.sampled_from(["absolute out", "relative out", "inside", "loop", "dangling"]))
    if shard.is_symlink():
        return "links: skipped, already a link"
    if kind == "inside":  # a link to a file inside the folder: fine
        (d / "blobs").mkdir(exist_ok=True)
        shard.rename(d / "blobs" / shard.name)
        shard.symlink_to(Path("blobs") / shard.name)
        return kind
    shard.unlink()
    target = {
        "absolute out": d.parent / DECOY,
        "relative out": Path("..") / DECOY,
        "loop": shard,
        "dangling": Path("nowhere"),
    }[kind]
    shard.symlink_to(target)
    return f"link {kind}"


MUTATIONS = {
    "header bytes": _header_bytes,
    "length prefix": _length_prefix,
    "truncate": _truncate_or_extend,
    "header field": _header_field,
    "index": _index,
    "config": _config,
    "links": _links,
}


# ---------------------------------------------------------------- guards and the reference


class Hang(BaseException):  # not an Exception: nothing in the loader may swallow it
    pass


@contextlib.contextmanager
def time_limit(seconds: int):
    def on_alarm(*_):
        raise Hang(f"the loader ran for more than {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@contextlib.contextmanager
def no_reads_outside(workdir: Path, folder: Path, monkeypatch):
    """Record every file opened under `workdir` (where the decoys are) but outside `folder`: Python's open,
    os.open, and the safetensors library's own (Rust) open."""
    workdir, folder = workdir.resolve(), folder.resolve()
    seen: list[str] = []

    def check(path) -> None:
        if isinstance(path, int):  # an already-open descriptor
            return
        with contextlib.suppress(TypeError, ValueError, OSError):
            real = Path(os.path.realpath(os.fsdecode(path)))
            if real.is_relative_to(workdir) and not real.is_relative_to(folder):
                seen.append(str(real))

    def wrap(fn):
        def guarded(path, *args, **kwargs):
            check(path)
            return fn(path, *args, **kwargs)

        return guarded

    with monkeypatch.context() as m:
        m.setattr(builtins, "open", wrap(builtins.open))
        m.setattr(io, "open", wrap(io.open))
        m.setattr(os, "open", wrap(os.open))
        m.setattr(sio, "safe_open", wrap(safe_open), raising=False)
        yield seen


def _reference_tensors(d: Path) -> dict[str, np.ndarray]:
    """What the `safetensors` library decodes from the folder (files as an HF loader picks them, inside the
    folder only); raises when it refuses a file."""
    root = d.resolve()
    if (d / INDEX).exists():
        names = set(json.loads((d / INDEX).read_text())["weight_map"].values())
    elif (d / "model.safetensors").exists():
        names = {"model.safetensors"}
    else:
        names = {p.name for p in d.glob("*.safetensors")}
    files = {(root / n).resolve() for n in names}
    assert all(f.is_relative_to(root) for f in files)
    out: dict[str, np.ndarray] = {}
    for f in sorted(files):
        with safe_open(f, framework="numpy") as sf:
            for k in sf.keys():
                assert k not in out, k
                out[k] = sf.get_tensor(k)
    return out


def _kind_of(msg: str) -> str:
    """The message with names and numbers blanked: a category for hypothesis' statistics."""
    msg = re.sub(r"'[^']*'|\"[^\"]*\"", "X", msg)
    return re.sub(r"\d+", "N", msg)[:90]


def _assert_same(params: dict, want: dict) -> None:
    assert params.keys() == want.keys()
    for p in want:
        assert params[p].dtype == want[p].dtype and params[p].shape == want[p].shape, p
        np.testing.assert_array_equal(params[p].view(np.uint8), want[p].view(np.uint8), err_msg=str(p))


# ---------------------------------------------------------------- the fuzz tests


def _run(data, pristine, original, monkeypatch, kinds: list[str]) -> None:
    with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
        work = Path(tmp)
        d = work / "ckpt"
        shutil.copytree(pristine, d)
        shutil.copy(pristine / SHARDS[0], work / DECOY)
        shutil.copy(pristine / "config.json", work / DECOY_JSON)
        done = [MUTATIONS[k](data, d) for k in data.draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=2))]
        note = "; ".join(done)
        with no_reads_outside(work, d, monkeypatch) as seen, time_limit(TIMEOUT_S):
            try:
                model = from_pretrained(d, dtype=jnp.float32, progress=False)
            except ValueError as e:  # CheckpointError is a ValueError
                msg = str(e)
                assert "\n" not in msg, (note, msg)
                assert str(d.resolve()) in msg or str(d) in msg, f"{note}: the message names no file: {msg}"
                event("refused: " + _kind_of(msg.replace(str(d.resolve()), "").replace(str(work.resolve()), "")))
                model = None
        assert not seen, f"{note}: opened {seen}, outside the checkpoint folder"
        if model is None:
            return
        cfg, params = original
        got = _params(model)
        if model.config == cfg and got.keys() == params.keys():
            if all(np.array_equal(got[p].view(np.uint8), params[p].view(np.uint8)) for p in params):
                event("loaded: the original model")
                return  # the mutation changed nothing that matters (e.g. padding, an unused metadata field)
        # Loaded, and different from the original: only fine if the mutated folder legitimately holds this
        # model. The reference: what the safetensors library decodes, re-written canonically, loaded again.
        try:
            tensors = _reference_tensors(d)
        except Exception as e:
            pytest.fail(f"{note}: loaded a model from a folder the safetensors library refuses ({e})")
        ref = work / "reference"
        ref.mkdir()
        save_file(tensors, ref / "model.safetensors")
        shutil.copy(d / "config.json", ref / "config.json")
        expected = from_pretrained(ref, dtype=jnp.float32, progress=False)
        assert model.config == expected.config, note
        _assert_same(got, _params(expected))
        event("loaded: another model, as the safetensors library reads the folder")


@FUZZ
@given(data=st.data())
def test_fuzzed_safetensors_headers(data, pristine, original, monkeypatch):
    _run(data, pristine, original, monkeypatch, ["header bytes", "length prefix", "truncate", "header field"])


@FUZZ
@given(data=st.data())
def test_fuzzed_index_config_and_links(data, pristine, original, monkeypatch):
    _run(data, pristine, original, monkeypatch, ["index", "config", "links", "header field"])


def test_the_fuzz_oracle_catches_a_silent_overlap(pristine, original, tmp_path):
    """The oracle is not vacuous: a loader that ignored overlaps would produce a model that differs from the
    original, which the safetensors library refuses to decode."""
    d = tmp_path / "ckpt"
    shutil.copytree(pristine, d)
    n, head, body = _read(d / SHARDS[0])
    header = json.loads(head)
    a, b = sorted(k for k in header if k.endswith("layernorm.weight"))[:2]
    header[b]["data_offsets"] = header[a]["data_offsets"]
    blob = json.dumps(header).encode()
    (d / SHARDS[0]).write_bytes(struct.pack("<Q", len(blob)) + blob + body)
    with pytest.raises(Exception, match="invalid offset"):
        _reference_tensors(d)
    with pytest.raises(CheckpointError, match="overlap"):
        from_pretrained(d, progress=False)


def test_the_fuzz_guard_sees_reads_outside_the_folder(pristine, tmp_path, monkeypatch):
    d = tmp_path / "ckpt"
    shutil.copytree(pristine, d)
    shutil.copy(pristine / SHARDS[0], tmp_path / DECOY)
    with no_reads_outside(tmp_path, d, monkeypatch) as seen:
        (d / SHARDS[0]).read_bytes()
        assert not seen
        (d / "../outside.safetensors").read_bytes()
        with sio.safe_open(str(tmp_path / DECOY), framework="numpy"):
            pass
        os.close(os.open(tmp_path / DECOY, os.O_RDONLY))
    assert seen == [str((tmp_path / DECOY).resolve())] * 3
