#!/usr/bin/env bash
# The vLLM-on-GPU procedure in one or two device calls: the GPU engine tests (tests/test_vllm_gpu.py), then the
# overhead benchmark (bench/vllm_gpu.py). Logs and JSON go to $OUT (default ./out/vllm_gpu): env.txt, the pytest log,
# gpu_*.json from the tests; bench_vllm_gpu.txt/.json, broker.log, consumer.log from the benchmark.
#   bash bench/vllm_gpu.sh test        the tests only       (about 4 minutes on an H100, vLLM install included;
#                                       GPU_TESTS: other test files, PYTEST_K: a -k expression)
#   bash bench/vllm_gpu.sh bench [ARGS] the benchmark only   (ARGS go to bench/vllm_gpu.py)
#   bash bench/vllm_gpu.sh [all]       both
#   bash bench/vllm_gpu.sh r3 [ARGS]    R3 at layer width (bench/r3_gpu.py: generated 8-layer Qwen3-30B-A3B-shaped
#                                       model, bf16 engine and trainer; about 4 minutes, R3_TIMEOUT_S caps it at 480 s):
#                                       r3_gpu.json/.txt and the log r3_gpu.log in $OUT; not part of `all`
# On the lent H100, vLLM 0.25.1 comes from the carried pieces (../shared/gpu-vllm/RECIPE.md):
# this script runs .carry/whl/install.sh when `vllm` is not importable. pytest comes from the environment, else from
# .carry/capture_pylib (a pure-Python copy). The plugin's entry point is declared through a dist-info directory in
# $HOME/rr-meta when the repository is not pip-installed, so that any engine process vLLM spawns loads it too.
set -u
cd "$(dirname "$0")/.."
mode=${1:-all}
[[ $# -gt 0 ]] && shift
OUT=${OUT:-$PWD/out/vllm_gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! python3 -c "import vllm" 2>/dev/null && [[ -f .carry/whl/install.sh ]]; then
  echo "== installing vLLM from the carried pieces"
  t0=$SECONDS
  bash .carry/whl/install.sh > "$OUT/env.txt" 2>&1 || { tail -20 "$OUT/env.txt"; exit 3; }
  line=$(tail -1 "$OUT/env.txt")
  eval "$line"
  echo "installed in $((SECONDS - t0)) s: $line"
fi
python3 -c "import pytest" 2>/dev/null || export PYTHONPATH="$PYTHONPATH:$PWD/.carry/capture_pylib"
if ! python3 -c "import importlib.metadata as m, sys; sys.exit(not any(e.name == 'routing_replay' for e in \
m.entry_points(group='vllm.general_plugins')))" 2>/dev/null; then
  meta=$HOME/rr-meta/routing_replay-0.1.0.dist-info
  mkdir -p "$meta"
  printf 'Metadata-Version: 2.1\nName: routing-replay\nVersion: 0.1.0\n' > "$meta/METADATA"
  printf '[vllm.general_plugins]\nrouting_replay = routing_replay.engines.vllm_plugin:register\n' > "$meta/entry_points.txt"
  export PYTHONPATH="$PYTHONPATH:$HOME/rr-meta"
fi

# the producer's C copy (producer/_gather.c): built in place where the checkout is not installed; numpy otherwise
if ! python3 -c "from routing_replay.producer import _gather" 2>/dev/null; then
  if python3 setup.py -q build_ext --inplace > "$OUT/build_ext.txt" 2>&1; then
    echo "producer/_gather.c built in place"
  else
    echo "producer/_gather.c not built ($OUT/build_ext.txt): the producer copies with numpy"
  fi
fi
python3 -c "from routing_replay.producer import outpool as m; print('producer copy', 'native' if m.NATIVE else 'numpy')" \
  2>&1 | tee -a "$OUT/env.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee -a "$OUT/env.txt"
python3 -c "import sys, torch, transformers, vllm; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'vllm', vllm.__version__)" 2>&1 \
  | tee -a "$OUT/env.txt"
rc=0
if [[ $mode == test || $mode == all ]]; then
  tests=${GPU_TESTS:-tests/test_vllm_gpu.py}
  echo "== pytest -m gpu $tests"
  t0=$SECONDS
  ROUTING_REPLAY_GPU_OUT=$OUT timeout "${TEST_TIMEOUT_S:-480}" python3 -m pytest -m gpu $tests -q -s ${PYTEST_K:+-k "$PYTEST_K"} \
    -p no:cacheprovider > "$OUT/pytest_vllm_gpu.txt" 2>&1
  r=$?
  grep -E "^\{|^E |FAILED|ERROR|passed|failed|skipped" "$OUT/pytest_vllm_gpu.txt" | cut -c1-1500 | tail -40
  echo "pytest rc=$r in $((SECONDS - t0)) s"
  [[ $r -ne 0 ]] && rc=$r
fi
if [[ $mode == bench || $mode == all ]]; then
  echo "== bench/vllm_gpu.py $*"
  t0=$SECONDS
  timeout "${BENCH_TIMEOUT_S:-540}" python3 bench/vllm_gpu.py --out "$OUT" "$@" > "$OUT/bench_vllm_gpu.txt" 2>&1
  r=$?
  grep -vE "^\(|^INFO|^WARNING|^\[|^$" "$OUT/bench_vllm_gpu.txt" | tail -40
  echo "bench rc=$r in $((SECONDS - t0)) s"
  [[ $r -ne 0 ]] && rc=$r
fi
if [[ $mode == r3 ]]; then
  echo "== bench/r3_gpu.py $*"
  t0=$SECONDS
  timeout "${R3_TIMEOUT_S:-480}" python3 bench/r3_gpu.py --out "$OUT" "$@" > "$OUT/r3_gpu.log" 2>&1
  r=$?
  grep -vE "^\(|^INFO|^WARNING|^\[|^$|it/s\]|^Loading|^Writing" "$OUT/r3_gpu.log" | tail -40
  echo "r3 rc=$r in $((SECONDS - t0)) s"
  [[ $r -ne 0 ]] && rc=$r
fi
exit $rc
