#!/usr/bin/env bash
# Everything the GPU machine runs in one call: install offline, the whole suite (CuPy tests included),
# the kernel benchmarks and the GPU request-path benchmarks. Outputs land in $OUT (or bench/out/gpu).
# Prepare on the dev machine first:  ../shared/tools/gpu-wheels.sh && pip wheel --no-deps -w .whl .
set -u
OUT=${OUT:-bench/out/gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import cupy, shmrpc.kernels as k; print('cupy', cupy.__version__, 'backend', k.select_backend('auto').name)"
timeout 300 python3 -m pytest -q --timeout 120 -p no:cacheprovider -rs tests 2>&1 | tee "$OUT/pytest.log" | tail -25
timeout 200 python3 bench/gpu_kernels.py --out "$OUT/gpu-kernels.json" 2>&1 | tee "$OUT/gpu-kernels.log" | tail -20
timeout 240 python3 bench/gpu_e2e.py --out "$OUT/gpu-e2e.json" 2>&1 | tee "$OUT/gpu-e2e.log" | tail -12
timeout 120 python3 bench/gpu/tiny_probe.py 2>&1 | tee "$OUT/tiny-probe.log" | tail -8
