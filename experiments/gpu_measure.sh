#!/usr/bin/env bash
# The memory plan measured on one lent GPU (docs/memory.md): a bare machine with python3 and
# pip, the package registry reachable. Installs jax[cuda12] and what the step imports into a
# venv, then runs the 7B-shaped LoGRA and dense steps on ONE GPU (the 1-device plan), each in
# its own process (peak_bytes_in_use is per process), and writes $OUT/gpu_measure.json.
# Budget: install <= 5 min (timeout 300; jax[cuda12] pulls ~3 GB of CUDA wheels), then each
# method's compile + 4 steps of 8 x 4,096 tokens, METHOD_TIMEOUT (170 s) each: <= 8 minutes
# once the wheels come at ordinary speed. A killed method leaves its JSON row 'no output'.
#   OUT=/tmp/out bash experiments/gpu_measure.sh            # MODEL=7b by default
#   TINY=1 OUT=/tmp/out bash experiments/gpu_measure.sh     # the tiny shape (any machine)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to a writable folder}
MODEL=${MODEL:-7b}
VENV=${VENV:-${TMPDIR:-/tmp}/logra_jax_venv_gpu}  # outside the work tree
mkdir -p "$OUT"
log() { echo "[gpu_measure $(date +%T)] $*" | tee -a "$OUT/gpu_measure.log"; }
if [ ! -x "$VENV/bin/python" ]; then
  log "installing into $VENV"
  python3 -m venv "$VENV" || exit 1
  pins=$(grep -E '^(flax|optax|chex|ml-collections|numpy|gguf|safetensors|absl-py)==' \
    requirements.txt | tr '\n' ' ')
  extra=$([ -n "${TINY:-}" ] && echo "jax==0.10.2" || echo "jax[cuda12]==0.10.2")
  timeout 300 "$VENV/bin/pip" install -q --disable-pip-version-check "$extra" $pins \
    >>"$OUT/gpu_measure.log" 2>&1 || { log "pip install failed"; exit 1; }
fi
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
# no preallocation: peak_bytes_in_use is what the step held (the BFC pool counts in-use bytes).
args=(--model="$MODEL")
[ -n "${TINY:-}" ] && args=(--tiny --micro_batches=2 --steps=3)
"$VENV/bin/python" -c 'import jax; print(jax.devices())' 2>&1 | tee -a "$OUT/gpu_measure.log"
for method in logra dense; do
  log "running $method"
  timeout "${METHOD_TIMEOUT:-170}" "$VENV/bin/python" experiments/gpu_measure.py "${args[@]}" \
    --methods=$method --out="$OUT/gpu_$method.json" >>"$OUT/gpu_measure.log" 2>&1 \
    || log "$method: exit $?"
done
"$VENV/bin/python" - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
rows = []
for m in ('logra', 'dense'):
  p = os.path.join(out, f'gpu_{m}.json')
  rows += json.load(open(p))['rows'] if os.path.exists(p) else [dict(method=m, run='no output')]
json.dump(dict(rows=rows), open(os.path.join(out, 'gpu_measure.json'), 'w'), indent=1)
print(json.dumps(dict(rows=rows)))
PY
