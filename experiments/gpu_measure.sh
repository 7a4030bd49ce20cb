#!/usr/bin/env bash
# The memory plan measured on one lent GPU (docs/memory.md). Runs the 7B-shaped LoGRA and
# dense steps on ONE GPU (the 1-device plan), each in its own process (peak_bytes_in_use is per
# process), and writes $OUT/gpu_measure.json. Two kinds of machine:
# - SITE set: a lent machine that reaches no registry (docs/gpu_study.md). The image's python3
#   (its jax with CUDA) runs with the wheels `gpu_study.sh stage` installed into $SITE, in one
#   call carrying .gpu_a: `bash experiments/gpu_study.sh stage && SITE=/tmp/site OUT=$OUT
#   bash experiments/gpu_measure.sh`.
# - otherwise a bare machine with python3 and pip, the registry reachable: jax[cuda12] and what
#   the step imports go into a venv (timeout 300; ~3 GB of CUDA wheels).
# Each method's compile + 4 steps of 8 x 4,096 tokens gets METHOD_TIMEOUT (170 s); a killed
# method leaves its JSON row 'no output'. METHODS (default 'logra dense') names the methods run.
#   OUT=/tmp/out bash experiments/gpu_measure.sh            # MODEL=7b by default
#   TINY=1 OUT=/tmp/out bash experiments/gpu_measure.sh     # the tiny shape (any machine)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to a writable folder}
MODEL=${MODEL:-7b}
VENV=${VENV:-${TMPDIR:-/tmp}/logra_jax_venv_gpu}  # outside the work tree
mkdir -p "$OUT"
log() { echo "[gpu_measure $(date +%T)] $*" | tee -a "$OUT/gpu_measure.log"; }
if [ -n "${SITE:-}" ]; then
  py=python3
  export PYTHONPATH=$SITE:$PWD
else
  py=$VENV/bin/python
  export PYTHONPATH=$PWD
  if [ ! -x "$py" ]; then
    log "installing into $VENV"
    python3 -m venv "$VENV" || exit 1
    pins=$(grep -E '^(flax|optax|chex|ml-collections|numpy|gguf|safetensors|absl-py)==' \
      requirements.txt | tr '\n' ' ')
    extra=$([ -n "${TINY:-}" ] && echo "jax==0.10.2" || echo "jax[cuda12]==0.10.2")
    timeout 300 "$py" -m pip install -q --disable-pip-version-check "$extra" $pins \
      >>"$OUT/gpu_measure.log" 2>&1 || { log "pip install failed"; exit 1; }
  fi
fi
export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
# no preallocation: peak_bytes_in_use is what the step held (the BFC pool counts in-use bytes).
args=(--model="$MODEL")
[ -n "${TINY:-}" ] && args=(--tiny --micro_batches=2 --steps=3)
"$py" -c 'import jax; print(jax.devices())' 2>&1 | tee -a "$OUT/gpu_measure.log"
for method in ${METHODS:-logra dense}; do
  log "running $method"
  timeout "${METHOD_TIMEOUT:-170}" "$py" experiments/gpu_measure.py "${args[@]}" \
    --methods=$method --out="$OUT/gpu_$method.json" >>"$OUT/gpu_measure.log" 2>&1 \
    || log "$method: exit $?"
done
"$py" - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
rows = []
for m in os.environ.get('METHODS', 'logra dense').split():
  p = os.path.join(out, f'gpu_{m}.json')
  rows += json.load(open(p))['rows'] if os.path.exists(p) else [dict(method=m, run='no output')]
json.dump(dict(rows=rows), open(os.path.join(out, 'gpu_measure.json'), 'w'), indent=1)
print(json.dumps(dict(rows=rows)))
PY
