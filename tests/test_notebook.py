"""docs/colab_quickstart.ipynb runs top to bottom on the CPU with the
small sizes it takes from JZO_NOTEBOOK_SMALL=1, in a real Jupyter kernel
(nbclient), so that it cannot rot: it installs nothing (jzo is here),
prints the devices, trains and draws the loss curve."""

import pathlib

import nbformat
from nbclient import NotebookClient

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "docs" / "colab_quickstart.ipynb"


def test_the_colab_quickstart_runs_on_cpu(tmp_path, monkeypatch):
  # The kernel inherits this environment (and runs in tmp_path: runs/colab is written there).
  monkeypatch.setenv("JZO_NOTEBOOK_SMALL", "1")
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  # Raises CellExecutionError, with the cell and its traceback, if a cell fails.
  NotebookClient(notebook, timeout=300, kernel_name="python3",
                 resources={"metadata": {"path": str(tmp_path)}}).execute()
  outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
  text = "".join(o.get("text", "") for o in outputs)
  assert "cpu device(s); host kernel:" in text
  assert "jzo: tiny" in text and "stage 2 + offload" in text
  assert "last step: loss" in text
  assert any("image/png" in o.get("data", {}) for o in outputs), "no loss plot"
  assert len((tmp_path / "runs" / "colab" / "metrics.jsonl").read_text().splitlines()) == 4
