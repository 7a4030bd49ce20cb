"""Every notebook in notebooks/ runs top to bottom without a cell error."""
import glob
import json
import os
import sys

import nbclient
import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, 'notebooks', '*.ipynb')))


def test_there_are_notebooks():
  assert NOTEBOOKS, 'notebooks/ has no .ipynb'


@pytest.fixture
def kernel_of_this_interpreter(tmp_path, monkeypatch):
  """A 'python3' kernelspec that runs THIS interpreter (the venv's), found first on JUPYTER_PATH.

  The venv's own spec says argv[0] = 'python', which resolves through PATH, not to the venv.
  """
  spec_dir = tmp_path / 'kernels' / 'python3'
  spec_dir.mkdir(parents=True)
  (spec_dir / 'kernel.json').write_text(json.dumps({
      'argv': [sys.executable, '-m', 'ipykernel_launcher', '-f', '{connection_file}'],
      'display_name': 'Python 3 (test)', 'language': 'python'}))
  monkeypatch.setenv('JUPYTER_PATH', str(tmp_path))
  monkeypatch.setenv('PYTHONPATH', os.pathsep.join(
      [ROOT] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]))
  monkeypatch.setenv('MPLBACKEND', 'Agg')
  return 'python3'


@pytest.mark.parametrize('path', NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, kernel_of_this_interpreter):
  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(
      nb, kernel_name=kernel_of_this_interpreter, timeout=300,
      resources={'metadata': {'path': os.path.dirname(path)}})
  client.execute()  # raises CellExecutionError on the first failing cell
