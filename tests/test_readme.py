"""The README's Python examples run as written, each block on its own (imports included, nothing carried over
from an earlier block). A block that starts with `# needs N devices` runs in a subprocess with N fake CPU
devices (JAX is already started in this process)."""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import xla_flags

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
NEEDS_DEVICES = re.compile(r"# needs (\d+) devices")


def _blocks() -> list[tuple[int, str]]:
    """(line of the block's first code line, code) of every ```python block."""
    text = README.read_text()
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in re.finditer(r"```python\n(.*?)```", text, re.S)]


BLOCKS = _blocks()
LOCAL = [(line, code) for line, code in BLOCKS if not NEEDS_DEVICES.match(code)]
ON_DEVICES = [(line, code) for line, code in BLOCKS if NEEDS_DEVICES.match(code)]


def _compiled(line: int, code: str):
    return compile("\n" * (line - 1) + code, str(README), "exec")  # tracebacks point at README lines


def test_readme_shows_every_public_entry_point():
    code = "\n".join(code for _, code in BLOCKS)
    for name in (
        "generate", "HybridLM", "init_cache", "prefill", "decode_step", "from_pretrained", "save_pretrained",
        "convert", "load_tokenizer", "use_pallas", "record_indexer", "record_router", "cache_bytes", "shard_params",
        "prefill_context_parallel", "kda", "verify", "commit",
    ):  # fmt: skip
        assert re.search(rf"\b{name}\b", code), f"no README example uses {name}"
    assert len(LOCAL) >= 4 and ON_DEVICES


@pytest.mark.slow
@pytest.mark.parametrize("line, code", LOCAL, ids=[f"line{line}" for line, _ in LOCAL])
def test_readme_example_runs_on_its_own(line, code, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)  # examples name repository files (configs/...) relative to the root
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # what an example writes stays in pytest's tmp
    namespace: dict = {"__name__": "__readme__"}
    exec(_compiled(line, code), namespace)
    if "pending" in namespace:  # the speculative example: 16 prompt tokens + 2 kept of a verified 3
        vocab = namespace["model"].config.vocab_size
        assert namespace["out"].tokens.shape == (1, 16) and namespace["logits"].shape == (1, 3, vocab)
        assert int(namespace["cache"].lengths[0]) == 18
    elif "gen" in namespace:  # the generate example
        assert namespace["out"].tokens.shape == (2, 16)
    elif "cache" in namespace and "logits" in namespace:  # the cache example ends on a decode step
        assert namespace["logits"].shape == (2, namespace["model"].config.vocab_size)


@pytest.mark.slow
@pytest.mark.parametrize("line, code", ON_DEVICES, ids=[f"line{line}" for line, _ in ON_DEVICES])
def test_readme_multi_device_example_runs(line, code):
    n = int(NEEDS_DEVICES.match(code).group(1))
    env = {
        **os.environ,
        "XLA_FLAGS": xla_flags(n),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(ROOT),
    }
    script = f"exec(compile({chr(10) * (line - 1) + code!r}, {str(README)!r}, 'exec'))"
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=900, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
