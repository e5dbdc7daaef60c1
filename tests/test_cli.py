"""The README's main command: `hybrid-jax generate` with no arguments on the embedded tiny model."""

import re
import subprocess
import sys

from hybrid_jax.cli import main


def test_cli_default_prints_text_and_tokens_per_second(capsys):
    assert main(["--max-new-tokens", "5", "--compile-cache", ""]) == 0
    out = capsys.readouterr().out
    assert "model: tiny" in out
    assert re.search(r"generated: '.*'", out)
    m = re.search(r"(\d+) tokens in [\d.]+ s: ([\d.]+) tokens/s", out)
    assert m and 1 <= int(m.group(1)) <= 5 and float(m.group(2)) > 0


def test_cli_rejects_unknown_config():
    proc = subprocess.run(
        [sys.executable, "-m", "hybrid_jax", "generate", "--config", "nope"], capture_output=True, text=True
    )
    assert proc.returncode != 0 and "--config 'nope'" in proc.stderr


def test_cli_takes_a_quant_file(tmp_path, capsys):
    q = tmp_path / "q.yaml"
    q.write_text("indexer: {dtype: mxfp8}\nkv_cache: {dtype: fp8, tile_size: 16}\nprojection: {dtype: bf16}\n")
    assert main(["generate", "--max-new-tokens", "3", "--compile-cache", "", "--quant", str(q)]) == 0
    assert "tokens/s" in capsys.readouterr().out
