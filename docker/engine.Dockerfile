# syntax=docker/dockerfile:1
# The GPU engine: vLLM's official OpenAI server image with routing-replay installed. The plugin registers
# itself through the `vllm.general_plugins` entry point and is inert until ROUTING_REPLAY_BROKER is set.
# The image's entrypoint stays `vllm serve`; the compose file passes flags only. Build from the repository root:
#   docker build -f docker/engine.Dockerfile -t routing-replay-engine .
# The plugin supports vLLM 0.32.x and 0.25.1 (routing_replay/vllm_plugin/plugin.py); keep the tag in that set.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}

WORKDIR /opt/routing-replay
COPY pyproject.toml README.md ./
COPY routing_replay ./routing_replay
COPY capture ./capture
COPY producer ./producer
COPY broker ./broker
COPY consumer ./consumer
COPY docker/healthcheck.py ./docker/
# vLLM's image installs its Python packages with uv into the system interpreter; add ours the same way (numpy
# and pyzmq are already there and are kept; msgpack is added).
RUN uv pip install --system --no-cache . \
    && python3 -c "import routing_replay.engines.vllm_plugin, vllm; from routing_replay.engines.vllm_plugin.plugin import check_version; check_version(vllm.__version__)"
WORKDIR /
