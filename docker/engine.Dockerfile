# syntax=docker/dockerfile:1
# The GPU engine: vLLM's official OpenAI server image with routing-replay installed. The plugin registers
# itself through the `vllm.general_plugins` entry point and is inert until ROUTING_REPLAY_BROKER is set.
# The image's entrypoint stays `vllm serve`; the compose file passes flags only. Build from the repository root:
#   docker build -f docker/engine.Dockerfile -t routing-replay-engine .
# The plugin supports vLLM 0.32.x and 0.25.1 (engines/vllm_plugin/plugin.py); keep the tag in that set.
# Stage `wheel` builds the wheel; the image installs only that wheel (no source tree in it), and the checks below
# import what was installed. The wheel is built in vLLM's own image: it carries the producer's C copy
# (producer/_gather.c, compiled with that image's compiler for its Python), so it is tagged for that interpreter.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0

FROM ${VLLM_IMAGE} AS wheel
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
RUN pip wheel --no-cache-dir --no-deps -w /dist .

FROM ${VLLM_IMAGE}
COPY --from=wheel /dist/ /tmp/dist/
# vLLM's image installs its Python packages with uv into the system interpreter; add ours the same way (numpy
# and pyzmq are already there and are kept; msgpack is added). The plugin must load from the installed package,
# through vLLM's entry point, from outside any source tree.
RUN uv pip install --system --no-cache /tmp/dist/routing_replay-*.whl && rm -rf /tmp/dist \
    && cd / && routing-replay --help >/dev/null \
    && python3 -c "import routing_replay.engines.vllm_plugin, vllm; from routing_replay.engines.vllm_plugin.plugin import check_version; check_version(vllm.__version__); from importlib.metadata import entry_points; assert [e.load() for e in entry_points(group='vllm.general_plugins') if e.name == 'routing_replay'] == [routing_replay.engines.vllm_plugin.register]"
WORKDIR /opt/routing-replay
COPY docker/healthcheck.py ./docker/
WORKDIR /
