"""experiments/gpu_study.sh (docs/gpu_study.md) and gpu_measure.sh: what can be checked without
a lent GPU.

The script carries our pins to a machine that reaches no registry: each package it names must
be pinned in requirements.txt (else `pack` downloads nothing for it and the study dies there).
"""
import json
import os
import re
import subprocess
import sys

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


def test_gpu_measure_runs_on_the_wheels_stage_installed(tmp_path):
  """`SITE=... gpu_measure.sh`: the image's python3 with $SITE on its path, no venv, no pip.

  Here python3 is this interpreter (first on PATH) and SITE holds only a sitecustomize that
  records its import: the step must run from that path, and no install may be tried."""
  site, out, bin_dir = tmp_path / 'site', tmp_path / 'out', tmp_path / 'bin'
  site.mkdir()
  bin_dir.mkdir()
  (bin_dir / 'python3').write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
  (bin_dir / 'python3').chmod(0o755)
  marker = tmp_path / 'site_imported'
  (site / 'sitecustomize.py').write_text(f'open({str(marker)!r}, "a").write("x")\n')
  env = dict(os.environ, SITE=str(site), OUT=str(out), TINY='1', METHODS='logra',
             VENV=str(tmp_path / 'no_venv'), PATH=f'{bin_dir}:{os.environ["PATH"]}')
  run = subprocess.run(['bash', os.path.join(ROOT, 'experiments', 'gpu_measure.sh')], env=env,
                       capture_output=True, text=True, timeout=600, check=False)
  assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
  log = (out / 'gpu_measure.log').read_text()
  assert 'installing' not in log and not (tmp_path / 'no_venv').exists(), log
  assert marker.exists(), 'the step did not run with $SITE on its path'
  rows = json.loads((out / 'gpu_measure.json').read_text())['rows']
  assert [r['method'] for r in rows] == ['logra'] and rows[0]['run'] == 'ok', rows
  assert rows[0]['plan']['peak'] > 0 and rows[0]['step_s_median'] > 0, rows
