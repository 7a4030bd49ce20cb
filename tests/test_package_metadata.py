"""The package metadata is true (issue 26): the Python it needs, every distribution it imports
declared in setup.cfg's install_requires (ranges) and pinned in requirements.txt, and CI
failing every skip (.ci/run exports CI=true).

Imports are read with `ast` (nothing is imported): every top-level third-party module named by
`logra_jax/` (lazy imports inside functions too) and `experiments/train.py`, mapped to its
distribution by the installed environment's `importlib.metadata.packages_distributions()`.
"""
import ast
import configparser
import glob
import importlib.metadata
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup_cfg():
  cfg = configparser.ConfigParser()
  cfg.read(os.path.join(ROOT, 'setup.cfg'))
  return cfg


def _name(requirement: str) -> str:
  return re.split(r'[<>=!~\[; ]', requirement.strip(), maxsplit=1)[0].lower().replace('_', '-')


def declared() -> set:
  text = _setup_cfg()['options']['install_requires']
  return {_name(r) for r in text.splitlines() if r.strip() and not r.strip().startswith('#')}


def pinned() -> set:
  lines = open(os.path.join(ROOT, 'requirements.txt')).read().splitlines()
  return {_name(l) for l in lines if '==' in l and not l.startswith('#')}


def imported_modules() -> set:
  files = glob.glob(os.path.join(ROOT, 'logra_jax', '**', '*.py'), recursive=True)
  files.append(os.path.join(ROOT, 'experiments', 'train.py'))
  mods = set()
  for path in files:
    for node in ast.walk(ast.parse(open(path).read(), path)):
      if isinstance(node, ast.Import):
        mods.update(a.name.split('.')[0] for a in node.names)
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        mods.add(node.module.split('.')[0])
  return {m for m in mods if m not in sys.stdlib_module_names and m != 'logra_jax'}


def test_python_requires_3_11_everywhere_it_is_stated():
  assert _setup_cfg()['options']['python_requires'] == '>=3.11'
  readme = open(os.path.join(ROOT, 'README.md')).read()
  assert 'Python ≥ 3.11' in readme and '3.10' not in readme
  assert sys.version_info >= (3, 11)


def test_every_imported_distribution_is_declared_and_pinned():
  dists = importlib.metadata.packages_distributions()
  needed = set()
  for mod in imported_modules():
    assert mod in dists, f'{mod} is imported by the library but not installed'
    needed.update(_name(d) for d in dists[mod])
  missing = needed - declared()
  assert not missing, f'imported but not in setup.cfg install_requires: {sorted(missing)}'
  unpinned = declared() - pinned()
  assert not unpinned, f'in install_requires but not pinned in requirements.txt: {unpinned}'


def test_ci_fails_every_skip():
  text = open(os.path.join(ROOT, '.ci', 'run')).read()
  assert re.search(r'^export CI=true$', text, re.M)
  assert 'make test' in text
