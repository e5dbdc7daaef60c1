"""Every notebook runs top to bottom in a fresh kernel (a failing cell fails the test) and is stored clean."""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests.conftest import TEST_XLA_FLAGS

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_the_notebooks_exist():
    names = [p.name for p in NOTEBOOKS]
    assert names == ["01_quickstart.ipynb", "02_indexer.ipynb", "03_context_parallel.ipynb", "04_quantization.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{path.name}: a cell holds outputs"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, monkeypatch):
    # The kernel inherits this environment: the repository on the path, CPU JAX, inline figures.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")  # figures become PNG outputs
    monkeypatch.setenv("XLA_FLAGS", TEST_XLA_FLAGS)  # no fake devices (a notebook asks for its own)
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, kernel_name="python3", timeout=600, resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError naming the cell on the first failure
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    images = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert images >= 1, f"{path.name} drew no figure"
