#!/usr/bin/env bash
# The whole GPU procedure for capture/ in one call: GPU tests, then the benchmark. Results go to $OUT.
#   bash bench/gpu_capture.sh            (from the repo root; OUT defaults to ./out/capture_gpu)
# pytest is taken from the environment, else from .carry/capture_pylib (pure-Python copy, for bare GPU hosts).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/capture_gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c "import pytest" 2>/dev/null || export PYTHONPATH="$PYTHONPATH:$PWD/.carry/capture_pylib"
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current \
    --format=csv 2>&1 | tee "$OUT/nvidia_smi.txt"
python -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__)" 2>&1 | tee "$OUT/versions.txt"
echo "== pytest -m gpu tests/test_capture_gpu.py"
timeout 240 python -m pytest -m gpu tests/test_capture_gpu.py -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.txt"
echo "pytest rc=${PIPESTATUS[0]}"
echo "== bench/capture_gpu.py"
timeout 300 python bench/capture_gpu.py --out "$OUT/capture_gpu.json" 2>&1 | tee "$OUT/bench.txt"
echo "bench rc=${PIPESTATUS[0]}"
