#!/usr/bin/env bash
# Everything the GPU machine runs in one call: install offline, the whole suite (CuPy tests included),
# the GPU request-path benchmarks, the kernel benchmarks, the tiny-request probe and `shmrpc bench`
# with its peers. Everything printed goes to $OUT/run.log; figures to JSON files beside it.
# Prepare on the dev machine first:  ../shared/tools/gpu-wheels.sh && pip wheel --no-deps -w .whl .
set -u
OUT=${OUT:-bench/out/gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 || exit 1
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc
  python3 -c "import cupy, shmrpc.kernels as k; print('cupy', cupy.__version__, 'backend', k.select_backend('auto').name)"
  echo "== pytest"; timeout 200 python3 -m pytest -q --timeout 120 -p no:cacheprovider -rs tests 2>&1 | tail -25
  echo "== bench/gpu_e2e.py"; timeout 150 python3 bench/gpu_e2e.py --seconds 3 --out "$OUT/gpu-e2e.json" 2>&1 | tail -8
  echo "== bench/gpu_kernels.py"; timeout 100 python3 bench/gpu_kernels.py --out "$OUT/gpu-kernels.json" 2>&1 | tail -20
  echo "== bench/gpu/tiny_probe.py"; timeout 60 python3 bench/gpu/tiny_probe.py 2>&1 | tail -14
  echo "== shmrpc bench lat --peers"
  timeout 150 python3 -m shmrpc.client.bench lat --peers --sizes 64,4K,1M,64M,256M --iters 1000 --backend cupy \
    --out "$OUT/bench-lat-gpu.json" --plots "$OUT/plots" -q 2>&1 | tail -30
  echo "== bench/gpu_kernels.py, SHMRPC_W4A16_H2=1 (float16 partial sums, opt-in)"
  SHMRPC_W4A16_H2=1 timeout 100 python3 bench/gpu_kernels.py --out "$OUT/gpu-kernels-h2.json" 2>&1 | grep -E "w4a16 M=|ceiling"
} 2>&1 | tee "$OUT/run.log"
