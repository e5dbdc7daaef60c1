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
