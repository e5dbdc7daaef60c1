"""The README's Python examples run as written (those that need no external checkpoint folder and no
extra devices, which the README marks with a leading `# needs ...` line)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    runnable = [b for b in blocks if "path/to" not in b and not b.startswith("# needs")]
    assert len(runnable) >= 2
    namespace: dict = {}
    exec(compile("\n".join(runnable), str(README), "exec"), namespace)  # blocks build on each other
    assert namespace["out"].tokens.shape == (2, 16)
    assert namespace["logits"].shape == (2, namespace["model"].config.vocab_size)
