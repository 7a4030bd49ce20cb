"""Every notebook in notebooks/ is stored without outputs, ends in a check, and runs top to
bottom in a fresh kernel without a cell error (so its final asserts hold).

Runtime: the three notebooks take ~1-2 min each on a quiet 2-core CPU (mostly XLA compiles).
"""
import ast
import glob
import json
import os
import sys

import nbclient
import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, 'notebooks', '*.ipynb')))


EXPECTED = {'01_sketches.ipynb', '02_predicted_kl.ipynb', '03_tiny_rl_run.ipynb'}


def test_there_are_the_notebooks():
  assert EXPECTED <= {os.path.basename(p) for p in NOTEBOOKS}, NOTEBOOKS


def _asserts(source: str) -> int:
  return sum(isinstance(node, ast.Assert) for node in ast.walk(ast.parse(source)))


@pytest.mark.parametrize('path', NOTEBOOKS, ids=os.path.basename)
def test_stored_without_outputs_and_ending_in_a_check(path):
  nb = nbformat.read(path, as_version=4)
  nbformat.validate(nb)
  code = [c for c in nb.cells if c.cell_type == 'code']
  with_outputs = [i for i, c in enumerate(code) if c.outputs or c.execution_count is not None]
  assert not with_outputs, f'{path}: code cells {with_outputs} have outputs (strip them)'
  assert code and nb.cells[-1] is code[-1], f'{path}: the last cell must be a code cell'
  assert _asserts(code[-1].source) >= 1, f'{path}: the last cell asserts nothing'


@pytest.fixture
def kernel_of_this_interpreter(tmp_path, monkeypatch, shared_xla_env):
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
  for key, value in shared_xla_env.items():  # notebook 03 compiles the ablations' programs
    monkeypatch.setenv(key, value)
  return 'python3'


@pytest.mark.parametrize('path', NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, kernel_of_this_interpreter):
  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(
      nb, kernel_name=kernel_of_this_interpreter, timeout=1200,  # per cell; a loaded CPU
      resources={'metadata': {'path': os.path.dirname(path)}})
  client.execute()  # raises CellExecutionError on the first failing cell
