"""Import floors: which packages of logra_jax may import which, read from the source with `ast`.

Nothing is imported: every module's `import` / `from … import` statements are parsed, those
inside functions (lazy imports) included, relative ones resolved against the module's package.
The floors (docs: DESIGN.md's package layout):
  - `logra_jax/sketch/` is the method, independent of RL and of models: its modules import no
    other logra_jax package;
  - `logra_jax/sketch/projection.py` is also rebuilt outside JAX (the vLLM plug-in): numpy and
    the standard library only;
  - `logra_jax/bridge/` and `logra_jax/models/` sit below the trainer: nothing in them imports
    `logra_jax.train`.
"""
import ast
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, 'logra_jax')


def module_name(path: str) -> str:
  """'logra_jax.sketch.kl' for .../logra_jax/sketch/kl.py (a package: its __init__'s name)."""
  rel = os.path.relpath(path, ROOT)[:-len('.py')].split(os.sep)
  return '.'.join(rel[:-1] if rel[-1] == '__init__' else rel)


def imported_names(source: str, module: str, is_package: bool = False) -> list:
  """(line, dotted name) of everything ``source`` (the module ``module``) imports.

  ``from a.b import c`` yields a.b and a.b.c (c may be a submodule); relative imports are
  resolved against ``module``'s package; ``importlib.import_module('x')`` with a constant
  name counts too.
  """
  package = module.split('.') if is_package else module.split('.')[:-1]
  out = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      out += [(node.lineno, a.name) for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ''
      if node.level:
        anchor = package[:len(package) - node.level + 1]
        base = '.'.join(anchor + ([base] if base else []))
      out.append((node.lineno, base))
      out += [(node.lineno, f'{base}.{a.name}') for a in node.names if a.name != '*']
    elif (isinstance(node, ast.Call) and getattr(node.func, 'attr', None) == 'import_module'
          and node.args and isinstance(node.args[0], ast.Constant)
          and isinstance(node.args[0].value, str)):
      out.append((node.lineno, node.args[0].value))
  return out


def modules_under(*parts) -> list:
  """Every .py file under logra_jax/<parts>, or that one file."""
  top = os.path.join(PACKAGE, *parts)
  if top.endswith('.py'):
    return [top]
  return sorted(os.path.join(d, f) for d, _, files in os.walk(top) for f in files
                if f.endswith('.py'))


def imports_of(path: str) -> list:
  with open(path, encoding='utf-8') as f:
    source = f.read()
  return imported_names(source, module_name(path), os.path.basename(path) == '__init__.py')


def violations(paths, allowed) -> list:
  """'file:line imports name' for every import of ``paths`` that ``allowed(name)`` refuses."""
  return [f'{os.path.relpath(p, ROOT)}:{line} imports {name}'
          for p in paths for line, name in imports_of(p) if not allowed(name)]


def _is_logra_package(name: str, package: str) -> bool:
  return name == f'logra_jax.{package}' or name.startswith(f'logra_jax.{package}.')


def test_the_parser_sees_lazy_relative_and_dynamic_imports():
  # A module logra_jax.models.x with one import of each kind, worked out by hand.
  source = '\n'.join([
      'import numpy as np',
      'from . import sampler',
      'from ..train import loop',
      'def f():',
      '  from logra_jax.train.steps import losses',
      '  return importlib.import_module("logra_jax.train.methods")',
  ])
  got = sorted(imported_names(source, 'logra_jax.models.x'))
  assert got == [(1, 'numpy'), (2, 'logra_jax.models'), (2, 'logra_jax.models.sampler'),
                 (3, 'logra_jax.train'), (3, 'logra_jax.train.loop'),
                 (5, 'logra_jax.train.steps'), (5, 'logra_jax.train.steps.losses'),
                 (6, 'logra_jax.train.methods')]
  # In a package's __init__, `from . import x` is the package itself.
  assert imported_names('from . import kl', 'logra_jax.sketch', is_package=True) == [
      (1, 'logra_jax.sketch'), (1, 'logra_jax.sketch.kl')]


def test_the_floors_have_modules_to_check():
  for part in ('sketch', 'bridge', 'models'):
    assert len(modules_under(part)) > 3, part
  assert any(name == 'numpy' for _, name in imports_of(modules_under('sketch',
                                                                      'projection.py')[0]))


def test_sketch_imports_no_other_logra_jax_package():
  allowed = lambda name: (not name.startswith('logra_jax.')
                          or _is_logra_package(name, 'sketch'))
  assert not violations(modules_under('sketch'), allowed)


def test_projection_imports_only_numpy_and_the_standard_library():
  ok = set(sys.stdlib_module_names) | {'numpy', '__future__'}
  allowed = lambda name: name.split('.')[0] in ok
  assert not violations(modules_under('sketch', 'projection.py'), allowed)


@pytest.mark.parametrize('package', ['bridge', 'models'])
def test_bridge_and_models_do_not_import_the_trainer(package):
  allowed = lambda name: not _is_logra_package(name, 'train')
  assert not violations(modules_under(package), allowed)
