"""experiments/gpu_study.sh (docs/gpu_study.md): what can be checked without a lent GPU.

The script carries our pins to a machine that reaches no registry: each package it names must
be pinned in requirements.txt (else `pack` downloads nothing for it and the study dies there).
"""
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, 'experiments', 'gpu_study.sh')


def _pinned_names():
  text = open(SCRIPT).read()
  return re.search(r"PINNED='([^']*)'", text).group(1).split()


def test_every_carried_package_is_pinned_in_requirements():
  pins = {re.split(r'==', line)[0].strip().lower().replace('_', '-')
          for line in open(os.path.join(ROOT, 'requirements.txt'))
          if '==' in line and not line.startswith('#')}
  names = _pinned_names()
  assert 'transformers' in names and 'reasoning-gym' in names
  missing = [n for n in names if n.lower().replace('_', '-') not in pins]
  assert not missing, f'gpu_study.sh carries packages requirements.txt does not pin: {missing}'


def test_the_script_parses_and_names_its_steps():
  assert subprocess.run(['bash', '-n', SCRIPT], check=False).returncode == 0
  out = subprocess.run(['bash', SCRIPT], capture_output=True, text=True, check=False)
  assert out.returncode == 2 and 'usage:' in out.stdout and 'pack|stage|run' in out.stdout
