#!/usr/bin/env bash
# Everything the GPU machine runs, in stages: install offline, then
#   suite   the whole test suite (CuPy tests included); gputests: only the tests marked gpu (the CuPy paths)
#   kernels the kernel benchmarks and the layernorm/softmax block probe (a part of gpu)
#   gpu     the GPU request-path benchmarks, the kernel benchmarks, the tiny-request probe,
#           the opt-in float16 w4a16 kernel
#   lat     `shmrpc bench lat --peers` on the CuPy worker, and the client sweep 1, 2, 4, 8
#   bw      `shmrpc bench bw --peers` on the CuPy worker, and `lat --peers` on the NumPy worker
#           (the transports alone, on this host's cores)
#   spin    `lat --peers` and the client sweep with worker and clients spinning 200 µs (--spin-us),
#           and a short `lat` next to zmq without spinning, for the same-run comparison
#   probe   the tiny-request probe, and short `lat` runs next to zmq with and without spinning
#   model   the example decoder layer (examples/decoder_layer.py): served by a CuPy worker that loads
#           the users' ops (--ops decoder_ops), 2 processes x 2 sessions, every step checked against
#           NumPy, next to the same layer run in process with CuPy (no RPC) -> $OUT/model-gpu.json
#   small   the floors of a Python round trip on this host (bench/gpu/floor_probe.py), then small requests (NumPy worker): 64 B and 1 MiB in-place vector_add, loan and call(),
#           with and without lanes, next to pyzmq and iceoryx2 (blocking and spinning), connect time;
#           then the same with worker and clients spinning 200 µs
#   smallgpu  64 B float32 scale on the CuPy worker, loan, call() and lanes next to pyzmq and iceoryx2
#   sweep   1, 2, 4, 8, 16 client processes of 64 B vector_add on the NumPy worker: loan, call(), blocking and
#           spinning lane, next to pyzmq and to each process running the op itself (own); sweepgpu: the same with
#           gemm x=16x256 @ w=256x256 float16 on the CuPy worker, x and w sent with every request (own: a CUDA
#           context and CuPy in every client process, inputs from host memory, the result back to host); the
#           UCX peer (ucx) too where its wheels were prepared (the ucx extra), else it is skipped with the reason
#   pool    1 worker vs 2 workers (`serve --devices`, one GPU each), 8 client processes through
#           shmrpc.client.Pool sending gemm against a resident weight (bench/pool.py); then
#           `shmrpc bench async` and `shmrpc bench threads` on this host's cores (NumPy worker)
#   (the stages that compare against a base tree record BASE_COMMIT, if given, as the base runs' commit)
#   ab      the tree sent against a base tree (the wheel in .whl/base/, installed beside it), interleaved twice:
#           64 B in-place vector_add on the NumPy worker, loan and lanes next to zmq, and 8 and 16 client
#           processes (loan and blocking lane) -> $OUT/ab-{base,new}-rN.json, $OUT/ab-clients-{base,new}-rN.json;
#           then bench/lane_trace.py --lane block for both, twice -> $OUT/lane-trace-block-{base,new}-rN.json;
#           AB_SPIN=N adds the 64 B run with the worker and the clients spinning N µs (--spin-us N) next to
#           iceoryx2 spinning -> $OUT/ab-spin-{base,new}-rN.json, and lane_trace.py --lane spin (the worker
#           spinning 200 µs) -> $OUT/lane-trace-spin-{base,new}-rN.json
#           AB_PIN=S:C runs those 64 B runs with --server-cpus S --client-cpus C (the 8/16-client runs and traces unpinned)
#   pin     where the server and the client run: the spinning lane and iceoryx2 spinning for each CPU pair of
#           PIN_PAIRS (server:client) -> $OUT/pin-probe-S-C.json; then 64 B in-place vector_add, every path with the
#           peers, not pinned and pinned to PIN (server:client, default 2:10), without and with --spin-us 200,
#           interleaved twice -> $OUT/pin-{free,pinned}-spin{0,200}-rN.json (PIN_MAIN=0: the probe only)
#   abrounds the 64 B A/B of ab with more rounds (AB_ROUNDS, default 4), every round pinned to one CPU each
#           (AB_PIN1 server:client, default 2:10), without and with --spin-us 200 (iceoryx2 spinning beside it)
#           -> $OUT/ab4-{,spin-}{base,new}-rN.json; then bench/lane_trace.py --lane block and spin for both trees,
#           twice -> $OUT/lane-trace-{block,spin}-{base,new}-rN.json
#   ltrace  only the lane traces of abrounds (bench/lane_trace.py, blocking and spinning, base tree and tree, twice);
#           LTRACE_LANES: the lanes (default "block spin"; block-call: call() through the blocking lane)
#   graphab the 256 MiB request of the graphs stage over ZeroMQ and both lanes (launched chunk graph), the tree against
#           .whl/base/, interleaved GRAPHAB_ROUNDS times (default 2); GRAPHAB_PATHS: the paths, ';'-separated labels of
#           bench/gpu_e2e.py (default "graph;graph, blocking lane;graph, spinning lane") -> $OUT/graphab-{base,new}-rN.json
#   graphgap  bench/gpu/graph_gap_probe.py: the 256 MiB request's chunk graph launched on its idle stream and behind a
#           2 ms kernel, in process: whether the device waits for the host's launch -> $OUT/graph-gap-probe.json
#   bigtrace  bench/gpu/big_trace.py: the 256 MiB request of the graphs stage stamped on both sides, over ZeroMQ and
#           through both lanes (BT_REPS requests each, default 20; BT_ARGS: more arguments, e.g. --mib 768) -> $OUT/big-trace.json
#   abblock the blocking lane and the ZeroMQ loan alone (nothing spins), the tree against the base tree, interleaved
#           4 times, unpinned and pinned to 2:10 and 2:3 -> $OUT/abblock-{base,new}-{free,2-10,2-3}-rN.json;
#           ABBLOCK_TRANSPORTS: the transports (default shmrpc-lane,shmrpc; e.g. add shmrpc-call-lane); prints p50s
#   lanecpu bench/lane_cpu.py: the client's and the worker's CPU per 64 B request through the blocking lane and its
#           p50, the tree against .whl/base/, 4 rounds interleaved, unpinned and pinned to 2:10 -> $OUT/lane-cpu-{free,2-10}.json
#   btl     bench/gpu/batch_timeline.py: the worker's steps per launched batch (launch, device, answers, the gap to the
#           next launch) under 8 gemm clients, per transport (BTL_TRANSPORTS) and arm (BTL_ARMS: default, singles, bwait)
#           -> $OUT/batch-timeline-TRANSPORT-ARM.json
#   gemmpin gemm x=16x256 w=256x256 float16 on the CuPy worker from 8 and 16 client processes (loan, both lanes),
#           unpinned and pinned (PIN_GEMM server:clients, default the worker on 2,10 and the clients on the other
#           CPUs), interleaved twice -> $OUT/gemmpin-{free,pinned}-rN.json
#   w4a16   bench/gpu/w4a16_probe.py: gemm_w4a16's kernels and their diagnostic builds next to fp16 cuBLAS (~35 s);
#           W4_PROBE_ARGS: more arguments for it (e.g. --ms 1,8 --skip epi0,ldsm0)
#   w4ab    bench/gpu/w4a16_probe.py (W4_PROBE_ARGS) of the tree against the base tree (.whl/base/), interleaved twice
#           -> $OUT/w4a16-probe-{base,new}-rN.{json,log}
#   pdl     bench/gpu/pdl_probe.py: gemm_w4a16 launched as programmatic dependent launches against plain launches,
#           the dependency checks (PDL_ARGS: more arguments, e.g. --ms 1,16)
#   launch  bench/gpu/launch_probe.py: the host's cost of one gemm_w4a16 call in pieces, the GPU held busy
#   sass    bench/gpu/sass_loop.py: gemm_w4a16's kernels built with nvcc, the chunk loop's instructions by opcode from
#           their SASS, and ptxas's registers -> $OUT/sass-loop.json
#   ncu     Nsight Compute (sections: speed of light, memory, warp states with every stall reason, scheduler,
#           occupancy) on the kernel gemm_w4a16 launches for M in NCU_MS (default 1 16 64) at 8192 x 8192, driven by
#           bench/gpu/w4a16_ncu.py -> $OUT/ncu-w4a16-mM.txt; NCU_OPCODES=1: the executed instructions by opcode and
#           the pipes' utilization instead -> $OUT/ncu-w4a16-opcodes-mM.txt
#   ncul2   Nsight Compute: the L2 sectors gemm_w4a16's kernels ask for against the DRAM bytes, the copies' shared-memory
#           wavefronts, per case of NCUL2_CASES (label:cfg:M:K:N; default w4a16_wk at 112 and 128 blocks, w4a16_wkc at 128,
#           w4a16_wk at 64) -> $OUT/ncu-l2-LABEL.txt
#   ncusrc  Nsight Compute on one kernel per case of NCUSRC_CASES (label:cfg:M:K:N; cfg empty: the table's): the sections
#           of ncu with the sampled warp stalls, and per SASS instruction its executed count and sampled stalls
#           (--page source) -> $OUT/ncu-src-LABEL.txt, $OUT/ncu-src-LABEL-sass.csv
#   graphs  the CUDA graphs of batches and of chunked runs: bench/gpu/tiny_probe.py --batch (in process), the
#           256 MiB request through the worker without its graph and with it, launched by the loop or run by an
#           executor thread, over ZeroMQ and through both lanes (bench/gpu_e2e.py --only graphs)
#   graphspin the graphs stage's 256 MiB request through the worker unpinned, then with every process on GRAPH_CPUS
#           (taskset, default 2,4,10,12) -> $OUT/gpu-graphs-e2e-{free,pinned}.json
#   gemmab  the tree sent against a base tree (.whl/base/), interleaved twice: gemm x=16x256 w=256x256 float16 on the
#           CuPy worker, 8 and 16 client processes (loan, blocking and spinning lane); the tree with launched batches
#           off (SHMRPC_CUDA_LAUNCH_BATCHES=0) as a third arm -> $OUT/gemmab-{base,nolaunch,new}-rN.json; GEMMAB_ARMS
#           picks the arms, among them wspin: the tree with the worker spinning 200 µs (--spin-us 200) between turns,
#           bwait: the tree with --batch-wait-us 100 (parked requests wait for the rest of their batch),
#           and singles: the tree with lone requests run as batches of one (SHMRPC_CUDA_BATCH_SINGLES=1; the tree
#           of 69c6f96, where that was the default, ran this arm as "new" and the default of today as "nosingles")
#   gemmtrees  the tree, the base tree (.whl/base/) and every tree in .whl/bis/<commit>/ (a wheel each): 8 clients of
#           gemm x=16x256 w=256x256 float16 over ZeroMQ on the CuPy worker, each tree's bench and worker, twice (the
#           second round in reverse order) -> $OUT/bis-<commit>-rN.json; then bench/gpu/mixed_trees.py with the
#           worker of the base tree and clients of MIXED_TREE (one of .whl/bis/, the same protocol) and back
#           -> $OUT/mixed.json
#   singlesab 64 B float32 scale on the CuPy worker (loan, call(), lanes, next to zmq), lone requests as batches of
#           one (on, SHMRPC_CUDA_BATCH_SINGLES=1) and run unbatched (off), interleaved twice -> $OUT/singlesab-*.json
#   device  bench/gpu/device_probe.py: cudaSetDevice and CuPy's Device context against DeviceScope, and the CuPy
#           backend's lone request path (64 B scale, small gemm) with each -> $OUT/device-probe.json
#   ztrace  bench/zmq_trace.py: a 64 B round trip over ZeroMQ stamped on both sides, shmrpc's loan against a bare
#           pyzmq DEALER/ROUTER echo, unpinned then under taskset ZT_CPUS -> $OUT/zmq-trace-{free,pinned}.json
#   scaleab 64 B float32 scale on the CuPy worker (loan, call(), lanes, next to zmq), the tree against .whl/base/,
#           interleaved twice -> $OUT/scaleab-{base,new}-rN.json
#   gemmprof  the CuPy worker under cProfile while 8 client processes send gemm x=16x256 @ w=256x256 float16 through
#           the spinning lane (bench/gpu/gemm_profile.py) -> $OUT/gemm-profile/profile.{txt,json}
#   inline1m  1 MiB (and 64 B) in-place vector_add on the NumPy worker next to iceoryx2 and zmq, the worker as it is
#           (1 MiB runs in the executor) and with --inline-max 4M (it runs on the loop thread), interleaved twice
#           -> $OUT/inline1m-{executor,inline}-rN.json (AB_TRACE=0 skips the ab stage's lane traces)
#   loop    the async and threads runs alone (NumPy worker, this host's cores, about 60 s), then
#           bench/async_loop_ab.py: the loop's lag and calls/s, wrap_future vs direct finish, interleaved
# Usage: bash bench/gpu/run.sh [STAGE ...]   (default: suite gpu lat bw; one device call holds at
# most 10 minutes, so run `suite lat`, `bw gpu` and `spin` as separate calls; `suite probe` fits one).
# Prepare on the dev machine first:  ../shared/tools/gpu-wheels.sh [the bench extra, pinned] &&
# pip wheel --no-deps -w .whl .   A .git on the device (if any) is not of the tree sent: pass SHMRPC_COMMIT=<hash>.
# Everything printed goes to $OUT/run-<stages>.log; figures to JSON files and PNGs (named as the JSON) beside it.
set -u
OUT=${OUT:-bench/out/gpu}
mkdir -p "$OUT"
stages=${*:-suite gpu lat bw}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 MPLBACKEND=Agg || exit 1
rm -rf /tmp/plots-*
BENCH="python3 -m shmrpc.bench"  # word-split on purpose: timeout runs no shell function
plot() {  # plot SRC_DIR NAME NEW_NAME: keep one PNG of a run, renamed, at the top of $OUT
  [ -f "$1/$2" ] && cp "$1/$2" "$OUT/$3"
}
sweep() {  # sweep MODE NAME ITERS [ARGS...]: MODE 64 B..256 MiB next to every peer -> $OUT/NAME.json, NAME.png
  local mode=$1 name=$2 iters=$3; shift 3
  echo "== shmrpc bench $mode --peers $*"
  timeout 170 $BENCH "$mode" --peers --sizes 64,4K,64K,1M,16M,64M,256M --iters "$iters" "$@" -q \
    --out "$OUT/$name.json" --plots "/tmp/plots-$name" 2>&1 | tail -36
  plot "/tmp/plots-$name" "$mode-$([ "$mode" = lat ] && echo latency || echo bandwidth).png" "$name.png"
}
clients() {  # clients NAME [ARGS...]: 1, 2, 4, 8 client processes, 64 B and 64 KiB, next to pyzmq
  local name=$1; shift
  echo "== shmrpc bench lat --clients 1,2,4,8 $*"
  timeout 100 $BENCH lat --transports shmrpc,zmq --peers zmq --sizes 64,64K --clients 1,2,4,8 --iters 5000 "$@" -q \
    --out "$OUT/$name.json" --plots "/tmp/plots-$name" 2>&1 | tail -24
  plot "/tmp/plots-$name" lat-scaling.png "$name-scaling.png"
}
short() {  # short NAME [ARGS...]: 64 B, 4 KiB, 1 MiB next to pyzmq, 5000 round trips
  local name=$1; shift
  echo "== shmrpc bench lat next to zmq $*"
  timeout 60 $BENCH lat --transports shmrpc,zmq --sizes 64,4K,1M --iters 5000 "$@" -q --out "$OUT/$name.json" 2>&1 \
    | tail -12
}
small() {  # small NAME ARGS...: 64 B and 1 MiB, every shmrpc path and lane next to zmq and iceoryx2, connects
  local name=$1; shift
  echo "== shmrpc bench lat (small requests) $*"
  timeout 90 $BENCH lat --lanes --peers zmq,iox2,iox2-spin --sizes 64,1M --iters 5000 --connect-iters 50 "$@" -q \
    --out "$OUT/$name.json" 2>&1 | tail -30
}
lane_traces() {  # bench/lane_trace.py for the base tree and the tree, twice, each lane of "$@" (block-call: --call)
  for r in 1 2; do
    for tree in $(trees_of_round "$r"); do
      site=/tmp/site commit=${SHMRPC_COMMIT:-}; [ "$tree" = base ] && site=/tmp/site-base:/tmp/site commit=${BASE_COMMIT:-base}
      for ln in "$@"; do
        lane=${ln%-call} more=(); [ "$lane" != "$ln" ] && more=(--call)
        echo "== round $r, $tree: bench/lane_trace.py --lane $lane ${more[*]} (where a lane's round trip goes)"
        PYTHONPATH=$site SHMRPC_COMMIT=$commit timeout 60 python3 bench/lane_trace.py --lane "$lane" "${more[@]}" --calls 20000 \
          --out "$OUT/lane-trace-$ln-$tree-r$r.json" 2>&1 | grep -v JSON
      done
    done
  done
}
trees_of_round() {  # the A/B stages' order in round $1: base first in odd rounds, the tree first in even ones (a
  # machine that speeds up or slows down during a call then favours neither)
  if [ $(( $1 % 2 )) = 1 ]; then echo "base new"; else echo "new base"; fi
}
base_site() {  # the base tree (.whl/base/, a wheel of another commit) installed beside /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-base \
    .whl/base/*.whl
}
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc
  echo "stages: $stages, commit ${SHMRPC_COMMIT:-unknown}"
  python3 -c "import cupy, shmrpc.kernels as k; print('cupy', cupy.__version__, 'backend', k.select_backend('auto').name)"
  for stage in $stages; do
    case $stage in
    suite)
      echo "== pytest (whole log: \$OUT/pytest-gpu.log)"
      timeout 330 python3 -m pytest -q --timeout 120 -p no:cacheprovider -rfEs tests > "$OUT/pytest-gpu.log" 2>&1
      grep -E '^(FAILED|ERROR)' "$OUT/pytest-gpu.log" | head -30; tail -3 "$OUT/pytest-gpu.log" ;;
    gputests)
      echo "== pytest -m gpu (whole log: \$OUT/pytest-gpu-marked.log)"
      timeout 240 python3 -m pytest -q -m gpu --timeout 120 -p no:cacheprovider -rfEs tests > "$OUT/pytest-gpu-marked.log" 2>&1
      grep -E '^(FAILED|ERROR)' "$OUT/pytest-gpu-marked.log" | head -30; tail -3 "$OUT/pytest-gpu-marked.log" ;;
    kernels)
      echo "== bench/gpu_kernels.py"; timeout 100 python3 bench/gpu_kernels.py --out "$OUT/gpu-kernels.json" 2>&1 | tail -20
      echo "== bench/gpu/ln_probe.py"; timeout 60 python3 bench/gpu/ln_probe.py --out "$OUT/ln-probe.json" 2>&1 | tail -16 ;;
    gpu)
      echo "== bench/gpu_e2e.py"; timeout 150 python3 bench/gpu_e2e.py --seconds 3 --out "$OUT/gpu-e2e.json" 2>&1 | tail -8
      echo "== bench/gpu_kernels.py"; timeout 100 python3 bench/gpu_kernels.py --out "$OUT/gpu-kernels.json" 2>&1 | tail -20
      echo "== bench/gpu/tiny_probe.py"; timeout 60 python3 bench/gpu/tiny_probe.py 2>&1 | tail -14
      echo "== bench/gpu/ln_probe.py"; timeout 60 python3 bench/gpu/ln_probe.py --out "$OUT/ln-probe.json" 2>&1 | tail -16
      echo "== bench/gpu_kernels.py, SHMRPC_W4A16_H2=1 (float16 partial sums, opt-in)"
      SHMRPC_W4A16_H2=1 timeout 100 python3 bench/gpu_kernels.py --out "$OUT/gpu-kernels-h2.json" 2>&1 \
        | grep -E "w4a16 M=|ceiling" ;;
    lat)
      sweep lat bench-lat-gpu 2000 --backend cupy
      clients bench-clients-gpu --backend cupy ;;
    bw)
      sweep bw bench-bw-gpu 500 --backend cupy
      sweep lat bench-lat-gpuhost-numpy 2000 --backend numpy ;;  # the transports alone, on this host's cores
    spin)
      sweep lat bench-lat-gpu-spin 2000 --backend cupy --spin-us 200
      clients bench-clients-gpu-spin --backend cupy --spin-us 200
      short bench-lat-gpu-nospin --backend cupy ;;
    probe)
      echo "== bench/gpu/tiny_probe.py"; timeout 90 python3 bench/gpu/tiny_probe.py 2>&1 | tail -16
      for spin in 0 200; do short "bench-lat-gpu-probe-spin$spin" --backend cupy --spin-us "$spin"; done ;;
    model)
      echo "== examples/decoder_layer.py --spawn cupy --inprocess cupy"
      PYTHONPATH="$PYTHONPATH:examples" timeout 90 python3 examples/decoder_layer.py --spawn cupy --inprocess cupy \
        --d 2048 --heads 16 --f 8192 --max-tokens 128 --tokens 96 --procs 2 --sessions 2 \
        --out "$OUT/model-gpu.json" 2>&1 | tail -6 ;;
    small)
      echo "== bench/gpu/floor_probe.py (Python's floors between two processes on this host)"
      timeout 60 python3 bench/gpu/floor_probe.py --out "$OUT/floor-probe.json" 2>&1 | tail -7
      small bench-small-cpu --backend numpy --op vector_add --dtype float32 --in-place
      small bench-small-cpu-spin --backend numpy --op vector_add --dtype float32 --in-place --spin-us 200 ;;
    pin)  # where the two processes run: a probe over CPU pairs, then the 64 B paths unpinned and pinned
      for pair in ${PIN_PAIRS:-2:3 2:4 2:5 2:10 2:11 6:13}; do
        echo "== placement: server on CPU ${pair%%:*}, client on CPU ${pair##*:}: spinning lane and iceoryx2 spinning"
        timeout 60 $BENCH lat --transports shmrpc-lane-spin,iox2-spin --sizes 64 --iters 2000 --backend numpy \
          --op vector_add --dtype float32 --in-place --spin-us 200 --server-cpus "${pair%%:*}" \
          --client-cpus "${pair##*:}" -q --out "$OUT/pin-probe-${pair/:/-}.json" 2>&1 | grep -E "^ +64B"
      done
      pin=${PIN:-2:10}
      for r in $([ "${PIN_MAIN:-1}" = 0 ] || echo 1 2); do
        for arm in free pinned; do
          cpus=(); [ "$arm" = pinned ] && cpus=(--server-cpus "${pin%%:*}" --client-cpus "${pin##*:}")
          for spin in 0 200; do
            echo "== round $r, $arm ${cpus[*]}, --spin-us $spin: 64 B vector_add in place (NumPy worker), all paths"
            timeout 90 $BENCH lat --lanes --peers zmq,iox2,iox2-spin --sizes 64 --iters 3000 --backend numpy \
              --op vector_add --dtype float32 --in-place --spin-us $spin "${cpus[@]}" -q \
              --out "$OUT/pin-$arm-spin$spin-r$r.json" 2>&1 | grep -E "^ +64B"
          done
        done
      done ;;
    gemmpin)  # gemm from 8 and 16 clients on the CuPy worker, unpinned and pinned (PIN_GEMM server:clients)
      pin=${PIN_GEMM:-2,10:0,1,3-9,11-15}
      for r in 1 2; do
        for arm in free pinned; do
          cpus=(); [ "$arm" = pinned ] && cpus=(--server-cpus "${pin%%:*}" --client-cpus "${pin##*:}")
          echo "== round $r, $arm ${cpus[*]}: gemm x=16x256 w=256x256 float16 on the CuPy worker, 8 and 16 clients"
          timeout 120 $BENCH lat --transports shmrpc,shmrpc-lane,shmrpc-lane-spin --clients 8,16 --iters 2000 \
            --warmup 50 --backend cupy --op gemm --shape x=16x256 --shape w=256x256 --dtype float16 "${cpus[@]}" -q \
            --out "$OUT/gemmpin-$arm-r$r.json" 2>&1 | grep -E "^shmrpc"
        done
      done ;;
    smallgpu)
      small bench-small-gpu --backend cupy --op scale --attr a=2 --attr b=1 --dtype float32 ;;
    sweep|sweepgpu)  # issue #12: requests/s of 1..16 client processes; each stage under 290 s
      if [ "$stage" = sweep ]; then
        what="numpy worker, 64 B vector_add"; args=(--backend numpy --op vector_add --dtype float32 --sizes 64)
        name=bench-sweep-numpy
      else  # x and w both sent with every request, as in bench/gpu_e2e.py's small-gemm row
        what="cupy worker, gemm x=16x256 w=256x256 float16"; name=bench-sweep-gemm-gpu
        args=(--backend cupy --op gemm --shape x=16x256 --shape w=256x256 --dtype float16)
      fi
      echo "== shmrpc bench lat --clients 1,2,4,8,16 ($what)"
      timeout 290 $BENCH lat --transports shmrpc,shmrpc-call,shmrpc-lane,shmrpc-lane-spin,zmq,own,ucx --clients 1,2,4,8,16 \
        --iters 2000 --warmup 50 "${args[@]}" -q --out "$OUT/$name.json" --plots "/tmp/plots-$name" 2>&1 | tail -60
      plot "/tmp/plots-$name" lat-scaling.png "$name-scaling.png" ;;
    pool)
      echo "== bench/pool.py (1 vs 2 GPU workers through Pool)"
      timeout 120 python3 bench/pool.py --backend cupy --workers 1,2 --clients 8 --window 2 --seconds 8 \
        --m 1024 --k 8192 --n 8192 --dtype float16 --slots 64K:16,1M:16,80M:8,288M:1 \
        --out "$OUT/pool-gpu.json" 2>&1 | tail -8
      echo "== shmrpc bench async / threads (NumPy worker, this host's cores)"
      timeout 60 $BENCH async --sizes 64 --iters 2000 --in-flight 1000 --total 20000 --backend numpy \
        --out "$OUT/bench-async-gpuhost.json" 2>&1 | tail -6
      timeout 40 $BENCH threads --threads 1,2,4,8 --sizes 64 --duration-s 2 --backend numpy \
        --out "$OUT/bench-threads-gpuhost.json" 2>&1 | tail -8 ;;
    w4a16)
      echo "== bench/gpu/w4a16_probe.py"
      timeout 150 python3 bench/gpu/w4a16_probe.py ${W4_PROBE_ARGS:-} --out "$OUT/w4a16-probe.json" > "$OUT/w4a16-probe.log" 2>&1
      grep -A12 "best correct case" "$OUT/w4a16-probe.log" ;;
    w4ab)  # the w4a16 probe of the tree against .whl/base/, interleaved twice (W4_PROBE_ARGS as for w4a16)
      base_site || exit 1
      for r in 1 2; do
        for tree in $(trees_of_round "$r"); do
          site=/tmp/site commit=${SHMRPC_COMMIT:-}; [ "$tree" = base ] && site=/tmp/site-base:/tmp/site commit=${BASE_COMMIT:-base}
          echo "== round $r, $tree: bench/gpu/w4a16_probe.py ${W4_PROBE_ARGS:-}"
          PYTHONPATH=$site SHMRPC_COMMIT=$commit timeout 150 python3 bench/gpu/w4a16_probe.py ${W4_PROBE_ARGS:-} \
            --out "$OUT/w4a16-probe-$tree-r$r.json" > "$OUT/w4a16-probe-$tree-r$r.log" 2>&1
          grep -E "product" "$OUT/w4a16-probe-$tree-r$r.log"
        done
      done ;;
    pdl)  # gemm_w4a16's tensor-core kernels as programmatic dependent launches against plain ones (PDL_ARGS: more
      # arguments for bench/gpu/pdl_probe.py) -> $OUT/pdl-probe.json, its printed output in $OUT/pdl-probe.log
      echo "== bench/gpu/pdl_probe.py ${PDL_ARGS:-}"
      timeout 200 python3 bench/gpu/pdl_probe.py ${PDL_ARGS:-} --out "$OUT/pdl-probe.json" > "$OUT/pdl-probe.log" 2>&1
      echo "rc $?"; sed -n '/^  M /,$p' "$OUT/pdl-probe.log"; grep -E "^error" "$OUT/pdl-probe.log" | head -5 ;;
    launch)  # the host's cost of one gemm_w4a16 call, in pieces (bench/gpu/launch_probe.py) -> $OUT/launch-probe.json
      echo "== bench/gpu/launch_probe.py"
      timeout 120 python3 bench/gpu/launch_probe.py --out "$OUT/launch-probe.json" 2>&1 | grep -v JSON ;;
    sass)  # the instruction mix of gemm_w4a16's chunk loop (SASS_CFGS: w4a16_wkc template arguments, ';'-separated)
      echo "== bench/gpu/sass_loop.py"
      timeout 120 python3 bench/gpu/sass_loop.py ${SASS_CFGS:+--cfgs "$SASS_CFGS"} --out "$OUT/sass-loop.json" 2>&1 \
        | grep -v JSON ;;
    ncu)  # Nsight Compute on the kernel gemm_w4a16 launches, M in NCU_MS at 8192 x 8192 -> $OUT/ncu-w4a16-mM.txt
      for mm in ${NCU_MS:-1 16 64}; do
        echo "== ncu: gemm_w4a16 M=$mm K=N=8192"
        if [ -n "${NCU_OPCODES:-}" ]; then  # the executed instructions by opcode and by pipe, instead of the sections
          nargs=(--metrics "sass__inst_executed_per_opcode,regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active,smsp__inst_executed.sum" --print-metric-instances details)
        else
          nargs=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats
                 --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis
                 --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio")
        fi
        timeout 240 ncu --kernel-name regex:w4a16 --launch-skip 20 --launch-count 1 "${nargs[@]}" \
          python3 bench/gpu/w4a16_ncu.py --m "$mm" > "$OUT/ncu-w4a16${NCU_OPCODES:+-opcodes}-m$mm.txt" 2>&1
        [ -n "${NCU_OPCODES:-}" ] && { grep -v "^==" "$OUT/ncu-w4a16-opcodes-m$mm.txt" | tail -45; continue; }
        grep -E "^M=|w4a16|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Issue Slots Busy|Warp Cycles Per Issued|Achieved Occupancy|Registers Per|stalled_(long_scoreboard|short_scoreboard|barrier|wait|math_pipe|mio|lg_throttle|not_selected|selected|dispatch|no_instruction|branch|membar|sleeping|tex|drain|misc|imc)" \
          "$OUT/ncu-w4a16-m$mm.txt" | head -40
      done ;;
    ncusrc)  # Nsight Compute per case, with the stalls per SASS instruction (sampled) -> $OUT/ncu-src-LABEL{.txt,-sass.csv}
      for c in ${NCUSRC_CASES:-m64:4,1,4,7:64:8192:8192 m64n14k:4,1,4,4:64:4096:14336}; do
        IFS=: read -r label cfg mm kk nn <<< "$c"
        echo "== ncu (source): $label M=$mm K=$kk N=$nn cfg=${cfg:-table}"
        SHMRPC_W4A16_MMA_CFG="$cfg" timeout 240 ncu --kernel-name regex:w4a16 --launch-skip 20 --launch-count 1 \
          --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
          --section WarpStateStats --section SchedulerStats --section Occupancy --section SourceCounters \
          --section InstructionStats --import-source no -o "/tmp/ncu-src-$label" -f \
          python3 bench/gpu/w4a16_ncu.py --m "$mm" --k "$kk" --n "$nn" > "$OUT/ncu-src-$label.txt" 2>&1
        ncu -i "/tmp/ncu-src-$label.ncu-rep" --print-details all >> "$OUT/ncu-src-$label.txt" 2>&1
        ncu -i "/tmp/ncu-src-$label.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu-src-$label-sass.csv" 2>&1
        grep -E "Duration|Issue Slots Busy|Warp Cycles Per Issued|Achieved Occupancy|Registers Per|No Eligible|Stall" \
          "$OUT/ncu-src-$label.txt" | cut -c1-130 | head -30
        head -c 600 "$OUT/ncu-src-$label-sass.csv"; echo
      done ;;
    ncul2)  # L2 requests against DRAM bytes of gemm_w4a16's kernels (docs/kernels.md, "Where M = 1 at 4096x14336 loses its
      # time"): NCUL2_CASES, space-separated label:cfg:M:K:N (cfg empty: the table's; commas as in SHMRPC_W4A16_MMA_CFG)
      # -> $OUT/ncu-l2-LABEL.txt
      met="dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum,l1tex__m_xbar2l1tex_read_sectors.sum,smsp__sass_l1tex_data_pipe_lsu_wavefronts_mem_shared_op_ldgsts.sum,smsp__inst_executed_op_ldgsts.sum,gpu__time_duration.sum"
      for c in ${NCUL2_CASES:-wk112::1:4096:14336 wk128::1:4096:16384 wkc128::1:8192:8192 wk64:0,4,8,0,3,1:1:8192:8192}; do
        IFS=: read -r label cfg mm kk nn <<< "$c"
        echo "== ncu (L2): $label M=$mm K=$kk N=$nn cfg=${cfg:-table}"
        SHMRPC_W4A16_MMA_CFG="$cfg" timeout 120 ncu --kernel-name regex:w4a16 --launch-skip 20 --launch-count 1 --metrics "$met" \
          python3 bench/gpu/w4a16_ncu.py --m "$mm" --k "$kk" --n "$nn" > "$OUT/ncu-l2-$label.txt" 2>&1
        grep -E "w4a16_w|dram__|lts__|xbar|wavefronts|inst_executed|gpu__time" "$OUT/ncu-l2-$label.txt" | cut -c1-120 | head -9
      done ;;
    graphs)
      echo "== bench/gpu/tiny_probe.py --batch"
      timeout 90 python3 bench/gpu/tiny_probe.py --batch --out "$OUT/gpu-batch-graphs.json" 2>&1 | tail -12
      echo "== bench/gpu_e2e.py --only graphs (256 MiB in + out through the worker, graph and plain)"
      timeout 150 python3 bench/gpu_e2e.py --only graphs --rounds 2 --reps 10 --out "$OUT/gpu-graphs-e2e.json" 2>&1 \
        | tail -10 ;;
    graphspin)  # the 256 MiB request through the worker, as the graphs stage, unpinned then every process on GRAPH_CPUS
      for arm in free pinned; do
        pin=(); [ "$arm" = pinned ] && pin=(taskset -c "${GRAPH_CPUS:-2,4,10,12}")
        echo "== $arm ${pin[*]}: bench/gpu_e2e.py --only graphs (256 MiB in + out through the worker)"
        timeout 150 "${pin[@]}" python3 bench/gpu_e2e.py --only graphs --rounds 2 --reps 10 \
          --out "$OUT/gpu-graphs-e2e-$arm.json" 2>&1 | tail -10
      done ;;
    ab)
      base_site || exit 1
      abpin=(); [ -n "${AB_PIN:-}" ] && abpin=(--server-cpus "${AB_PIN%%:*}" --client-cpus "${AB_PIN##*:}")
      for r in 1 2; do
        for tree in $(trees_of_round "$r"); do
          site=/tmp/site commit=${SHMRPC_COMMIT:-}; [ "$tree" = base ] && site=/tmp/site-base:/tmp/site commit=${BASE_COMMIT:-base}
          echo "== round $r, $tree: 64 B vector_add in place (NumPy worker), lanes next to zmq; 8 and 16 clients"
          PYTHONPATH=$site SHMRPC_COMMIT=$commit timeout 60 $BENCH lat --lanes --peers zmq --sizes 64 --iters 3000 --backend numpy \
            --op vector_add --dtype float32 --in-place "${abpin[@]}" -q --out "$OUT/ab-$tree-r$r.json" 2>&1 | grep -E "^ +64B"
          if [ -n "${AB_SPIN:-}" ]; then  # the same with the worker and the shmrpc clients spinning AB_SPIN µs
            echo "== round $r, $tree: the same, --spin-us $AB_SPIN, next to iceoryx2 spinning"
            PYTHONPATH=$site SHMRPC_COMMIT=$commit timeout 60 $BENCH lat --lanes --peers zmq,iox2-spin --sizes 64 --iters 3000 --backend numpy \
              --op vector_add --dtype float32 --in-place --spin-us "$AB_SPIN" "${abpin[@]}" -q --out "$OUT/ab-spin-$tree-r$r.json" \
              2>&1 | grep -E "^ +64B"
          fi
          PYTHONPATH=$site SHMRPC_COMMIT=$commit timeout 60 $BENCH lat --transports shmrpc,shmrpc-lane --clients 8,16 --iters 3000 \
            --backend numpy --op vector_add --dtype float32 --sizes 64 -q --out "$OUT/ab-clients-$tree-r$r.json" \
            2>&1 | grep -E "^shmrpc"
        done
      done
      [ "${AB_TRACE:-1}" = 0 ] && continue
      lane_traces block ${AB_SPIN:+spin} ;;
    abrounds)
      base_site || exit 1
      pin1=${AB_PIN1:-2:10}
      for r in $(seq 1 "${AB_ROUNDS:-4}"); do
        for tree in $(trees_of_round "$r"); do
          site=/tmp/site commit=${SHMRPC_COMMIT:-}; [ "$tree" = base ] && site=/tmp/site-base:/tmp/site commit=${BASE_COMMIT:-base}
          echo "== round $r, $tree: no spin"
          PYTHONPATH=$site SHMRPC_COMMIT=$commit timeout 80 $BENCH lat --lanes --peers zmq --sizes 64 --iters 4000 --backend numpy \
            --op vector_add --dtype float32 --in-place --server-cpus "${pin1%%:*}" --client-cpus "${pin1##*:}" -q \
            --out "$OUT/ab4-$tree-r$r.json" 2>&1 | grep -E "^ +64B"
          echo "== round $r, $tree: --spin-us 200, iceoryx2 spinning"
          PYTHONPATH=$site SHMRPC_COMMIT=$commit timeout 80 $BENCH lat --lanes --peers zmq,iox2-spin --sizes 64 --iters 4000 --backend numpy \
            --op vector_add --dtype float32 --in-place --spin-us 200 --server-cpus "${pin1%%:*}" \
            --client-cpus "${pin1##*:}" -q --out "$OUT/ab4-spin-$tree-r$r.json" 2>&1 | grep -E "^ +64B"
        done
      done
      lane_traces block spin ;;
    ltrace)
      base_site || exit 1
      lane_traces ${LTRACE_LANES:-block spin} ;;
    graphab)
      base_site || exit 1
      for r in $(seq "${GRAPHAB_ROUNDS:-2}"); do
        for tree in $(trees_of_round "$r"); do
          site=/tmp/site commit=${SHMRPC_COMMIT:-}; [ "$tree" = base ] && site=/tmp/site-base:/tmp/site commit=${BASE_COMMIT:-base}
          echo "== round $r, $tree: bench/gpu_e2e.py --only graphs (256 MiB: ${GRAPHAB_PATHS:-ZeroMQ, blocking lane, spinning lane})"
          PYTHONPATH=$site SHMRPC_COMMIT=$commit timeout 120 python3 bench/gpu_e2e.py --only graphs --rounds 1 --reps 12 \
            --graph-paths "${GRAPHAB_PATHS:-graph;graph, blocking lane;graph, spinning lane}" \
            --out "$OUT/graphab-$tree-r$r.json" 2>&1 | tail -5
        done
      done ;;
    graphgap)
      echo "== bench/gpu/graph_gap_probe.py (does the device wait for the chunk graph's launch?)"
      timeout 120 python3 bench/gpu/graph_gap_probe.py --reps 20 --out "$OUT/graph-gap-probe.json" 2>&1 | grep -v JSON ;;
    bigtrace)
      echo "== bench/gpu/big_trace.py (where a 256 MiB request's time goes outside the worker's span)"
      timeout 400 python3 bench/gpu/big_trace.py --reps ${BT_REPS:-20} ${BT_ARGS:-} --out "$OUT/big-trace.json" 2>&1 | grep -v JSON ;;
    abblock)
      base_site || exit 1
      lscpu | grep -E "Thread|Core|Socket|NUMA node0"
      for r in 1 2 3 4; do
        for tree in $(trees_of_round "$r"); do
          site=/tmp/site commit=${SHMRPC_COMMIT:-}; [ "$tree" = base ] && site=/tmp/site-base:/tmp/site commit=${BASE_COMMIT:-base}
          for pin in free 2:10 2:3; do
            pa=(); [ $pin != free ] && pa=(--server-cpus "${pin%%:*}" --client-cpus "${pin##*:}")
            echo -n "r$r $tree $pin: "
            PYTHONPATH=$site SHMRPC_COMMIT=$commit timeout 60 $BENCH lat --transports "${ABBLOCK_TRANSPORTS:-shmrpc-lane,shmrpc}" \
              --sizes 64 --iters 5000 --backend numpy --op vector_add --dtype float32 --in-place "${pa[@]}" -q \
              --out "$OUT/abblock-$tree-${pin/:/-}-r$r.json" 2>&1 | grep -E "^ +64B" \
              | awk '{for (i = 3; i <= NF; i++) if ($i ~ /^[0-9]+$/) break; l = ""; for (j = 3; j < i; j++) l = l $j; printf "%s=%s ", l, $(i + 2)}'
            echo
          done
        done
      done ;;
    lanecpu)
      base_site || exit 1
      for pin in free 2:10; do
        pa=(); [ $pin != free ] && pa=(--cpus "$pin")
        echo "== bench/lane_cpu.py, blocking lane, $pin"
        timeout 200 python3 bench/lane_cpu.py --calls 20000 --rounds 4 --tree "base=/tmp/site-base:/tmp/site" \
          --tree new=/tmp/site "${pa[@]}" --out "$OUT/lane-cpu-${pin/:/-}.json"
      done ;;
    gemmab)
      base_site || exit 1
      for r in 1 2; do
        for arm in ${GEMMAB_ARMS:-base nolaunch new}; do
          site=/tmp/site commit=${SHMRPC_COMMIT:-}; [ "$arm" = base ] && site=/tmp/site-base:/tmp/site commit=${BASE_COMMIT:-base}
          launch=1; [ "$arm" = nolaunch ] && launch=0
          singles=0; [ "$arm" = singles ] && singles=1
          wargs=""; [ "$arm" = wspin ] && wargs="--spin-us 200"; [ "$arm" = bwait ] && wargs="--batch-wait-us 100"
          echo "== round $r, $arm: gemm x=16x256 w=256x256 float16 on the CuPy worker, 8 and 16 clients"
          SHMRPC_CUDA_LAUNCH_BATCHES=$launch SHMRPC_CUDA_BATCH_SINGLES=$singles PYTHONPATH=$site SHMRPC_COMMIT=$commit timeout 90 $BENCH lat \
            --transports shmrpc,shmrpc-lane,shmrpc-lane-spin --clients 8,16 --iters 2000 --warmup 50 --backend cupy \
            --op gemm --shape x=16x256 --shape w=256x256 --dtype float16 --worker-args "$wargs" -q \
            --out "$OUT/gemmab-$arm-r$r.json" 2>&1 | grep -E "^shmrpc"
        done
      done ;;
    gemmtrees)
      base_site || exit 1
      trees="base"
      for w in .whl/bis/*/; do
        [ -d "$w" ] || continue  # (none: the base and the tree only)
        c=$(basename "$w"); trees="$trees $c"
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "/tmp/site-$c" "$w"*.whl
      done
      trees="$trees new"
      if [ -n "${MIXED_TREE:-}" ]; then
        echo "== worker:clients of base (b) and $MIXED_TREE (m), 8 clients of gemm over ZeroMQ"
        timeout 200 python3 bench/gpu/mixed_trees.py --pair bb=/tmp/site-base:/tmp/site-base \
          --pair mb=/tmp/site-$MIXED_TREE:/tmp/site-base --pair bm=/tmp/site-base:/tmp/site-$MIXED_TREE \
          --pair mm=/tmp/site-$MIXED_TREE:/tmp/site-$MIXED_TREE --rounds 3 --out "$OUT/mixed.json"
      fi
      for r in 1 2; do
        [ "$r" = 2 ] && trees=$(echo $trees | tr ' ' '\n' | tac | tr '\n' ' ')
        for t in $trees; do
          site=/tmp/site-$t:/tmp/site commit=$t
          [ "$t" = new ] && site=/tmp/site commit=${SHMRPC_COMMIT:-}
          [ "$t" = base ] && commit=${BASE_COMMIT:-base}
          PYTHONPATH=$site SHMRPC_COMMIT=$commit timeout 80 $BENCH lat --transports shmrpc --clients 8 --iters 2000 \
            --warmup 50 --backend cupy --op gemm --shape x=16x256 --shape w=256x256 --dtype float16 -q \
            --out "$OUT/bis-$t-r$r.json" > /dev/null 2>&1
          python3 -c "import json; d = json.load(open('$OUT/bis-$t-r$r.json')); p = d['scaling'][0]
print('round $r', '$t', round(p['calls_per_s']), 'requests/s, mean batch', p.get('worker', {}).get('mean_batch'))"
        done
      done ;;
    device)  # what entering the CUDA device costs per request: cupy.cuda.Device against DeviceScope
      echo "== bench/gpu/device_probe.py"
      timeout 120 python3 bench/gpu/device_probe.py --out "$OUT/device-probe.json" 2>&1 | grep -v JSON ;;
    ztrace)  # where a 64 B round trip over ZeroMQ goes, shmrpc's loan against a bare pyzmq echo; then all on ZT_CPUS
      echo "== bench/zmq_trace.py"
      timeout 120 python3 bench/zmq_trace.py --rounds 2 --out "$OUT/zmq-trace-free.json" 2>&1 | grep -v JSON
      echo "== taskset -c ${ZT_CPUS:-2,4,10,12} bench/zmq_trace.py"
      timeout 120 taskset -c "${ZT_CPUS:-2,4,10,12}" python3 bench/zmq_trace.py --rounds 2 \
        --out "$OUT/zmq-trace-pinned.json" 2>&1 | grep -v JSON ;;
    scaleab)  # the tree against .whl/base/ on the CuPy worker: 64 B scale (lanes next to zmq), interleaved twice
      base_site || exit 1
      for r in 1 2; do
        for tree in $(trees_of_round "$r"); do
          site=/tmp/site commit=${SHMRPC_COMMIT:-}; [ "$tree" = base ] && site=/tmp/site-base:/tmp/site commit=${BASE_COMMIT:-base}
          echo "== round $r, $tree: 64 B scale on the CuPy worker, lanes next to zmq"
          PYTHONPATH=$site SHMRPC_COMMIT=$commit timeout 90 $BENCH lat --lanes --peers zmq --sizes 64 --iters 3000 --backend cupy \
            --op scale --attr a=2 --attr b=1 --dtype float32 -q --out "$OUT/scaleab-$tree-r$r.json" 2>&1 | grep -E "^ +64B"
        done
      done ;;
    singlesab)
      for r in 1 2; do
        for arm in off on; do
          singles=1; [ "$arm" = off ] && singles=0
          echo "== round $r, singles $arm: 64 B scale on the CuPy worker, lanes next to zmq"
          SHMRPC_CUDA_BATCH_SINGLES=$singles timeout 90 $BENCH lat --lanes --peers zmq --sizes 64 --iters 3000 \
            --backend cupy --op scale --attr a=2 --attr b=1 --dtype float32 -q --out "$OUT/singlesab-$arm-r$r.json" \
            2>&1 | grep -E "^ +64B"
        done
      done ;;
    gemmprof)
      echo "== bench/gpu/gemm_profile.py: the CuPy worker under cProfile, 8 clients of gemm 16x256 @ 256x256 float16"
      timeout 200 python3 bench/gpu/gemm_profile.py --clients 8 --transport shmrpc-lane-spin --iters 2000 \
        --out "$OUT/gemm-profile" 2>&1 | tail -3
      sed -n '1,/===== worker: top 45 by cumulative/p' "$OUT/gemm-profile/profile.txt" | grep -E "^ +[0-9]" | head -40 ;;
    btl)  # bench/gpu/batch_timeline.py: the worker's steps per launched batch, 8 gemm clients (BTL_TRANSPORTS, BTL_ARMS)
      for tr in ${BTL_TRANSPORTS:-shmrpc-lane-spin shmrpc-lane}; do
        for arm in ${BTL_ARMS:-default singles bwait}; do
          singles=0; [ "$arm" = singles ] && singles=1
          wargs=""; [ "$arm" = bwait ] && wargs="--batch-wait-us 100"
          echo "== $tr, $arm: the worker's steps per launched batch, 8 clients of gemm x=16x256 w=256x256 float16"
          SHMRPC_CUDA_BATCH_SINGLES=$singles timeout 120 python3 bench/gpu/batch_timeline.py --clients 8 \
            --transport "$tr" --worker-args "$wargs" --out "$OUT/batch-timeline-$tr-$arm.json" 2>&1 | tail -18
        done
      done ;;
    inline1m)
      for r in 1 2; do
        for arm in executor inline; do
          wargs=""; [ "$arm" = inline ] && wargs="--inline-max 4M"
          echo "== round $r, $arm: 1 MiB vector_add in place (NumPy worker) next to iceoryx2, worker args '$wargs'"
          timeout 60 $BENCH lat --transports shmrpc,shmrpc-lane,iox2,zmq --sizes 64,1M --iters 2000 \
            --backend numpy --op vector_add --dtype float32 --in-place --worker-args "$wargs" -q \
            --out "$OUT/inline1m-$arm-r$r.json" 2>&1 | grep -E "^ +(64B|1M)"
        done
      done ;;
    loop)
      echo "== shmrpc bench async / threads (NumPy worker, this host's cores)"
      timeout 40 $BENCH async --sizes 64 --iters 2000 --in-flight 1000 --total 20000 --backend numpy \
        --out "$OUT/bench-async-gpuhost-loop.json" 2>&1 | tail -6
      timeout 40 $BENCH threads --threads 1,2,4,8 --sizes 64 --duration-s 2 --backend numpy \
        --out "$OUT/bench-threads-gpuhost-loop.json" 2>&1 | tail -8
      echo "== bench/async_loop_ab.py (wrap_future vs direct finish, 3 rounds)"
      timeout 60 python3 bench/async_loop_ab.py --rounds 3 --out "$OUT/bench-async-gpuhost-loop-ab.json" \
        2>&1 | tail -16 ;;
    *) echo "unknown stage $stage (suite, gputests, kernels, ncul2, ncusrc, gpu, lat, bw, spin, probe, model, small, pin, gemmpin, graphspin, smallgpu, sweep, sweepgpu, pool, ab, gemmab, w4a16, graphs, gemmprof, inline1m, singlesab, loop)" ;;
    esac
  done
} 2>&1 | tee "$OUT/run-${stages// /-}.log"
