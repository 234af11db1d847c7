#!/usr/bin/env bash
# Every GPU figure of docs/performance.md in one call, after the kit's setup (README.md here):
#   bash tests/benchmarks/device/figures.sh [PART ...]
#       PARTs: network start job ceiling gpu tests int8 (default: network start job)
# network: the default network alone (bench_network.py) and its GPU time by kernel (probe_kernels.py); start: where a
# gpu server's start goes (probe_build.py, probe_start.py);
# job: the whole job as a user types it, on 100,000 files (bench_job.py via job.sh), the default, the previous
# network layout and the in-process engine side by side; ceiling: the served path with one setting of its shape
# changed per row, the Triton hop without decode or network among them; gpu: bench_gpu.py's parts in one run (DALI alone, the networks alone, the engine
# in process, parity, odd inputs, the local Triton with ResNet-50 under MPS); tests: the GPU tier (tests/gpu/);
# int8: INT8 on the host's CPU pinned to 2 cores (int8_cpu.sh; results under $OUT/i8).
# Results under $OUT/f (network, gpu, tests) and $OUT/j (job).
set -u
source "$HOME/env/activate.sh"
parts=${*:-network start job}
mkdir -p "$OUT/f"
for part in $parts; do
  case $part in
    network) for cudnn in benchmark off; do  # the in-process engine's cuDNN setting, then the served instances'
               mkdir -p "$OUT/f/$cudnn"
               timeout 200 python3 tests/benchmarks/bench_network.py --out "$OUT/f/$cudnn" --budget-s 120 --cudnn $cudnn \
                 --layouts explicit,mirror,mirror_gemm > "$OUT/f/network-$cudnn.log" 2>&1
               echo "bench_network --cudnn $cudnn rc=$?"; grep -v "^[0-9-]* [0-9:,]* " "$OUT/f/network-$cudnn.log" | tail -16
             done
             timeout 110 python3 tests/benchmarks/device/probe_kernels.py --layouts mirror,mirror_gemm --seconds 3 \
               --top 10 > "$OUT/f/kernels.log" 2>&1
             echo "probe_kernels rc=$?"; grep -E "^==|kernels|owner|classify" "$OUT/f/kernels.log" ;;
    start)   timeout 200 python3 tests/benchmarks/device/probe_build.py 4 benchmark limit1 off 2>&1 | grep -v '^ *[0-9.]* s ' | tail -12
             timeout 120 python3 tests/benchmarks/device/probe_start.py 4 2>&1 | tail -30 ;;
    job)     bash tests/benchmarks/device/job.sh --images 100000 --timeout-s 90 --oddities default \
               --gpu-repo mirror:network=mirror,instances=4,max_backlog=4 \
               ${JOB_VARIANTS:---variant default= --variant mirror='--engine triton @mirror' --variant inproc=--engine=gpu --variant default_again=} ;;
    ceiling) r=instances=4,max_backlog=4  # the gpu profile's own instances and backlog, one setting changed per row
             bash tests/benchmarks/device/job.sh --images 100000 --timeout-s 90 --gpu-repo none:network=none,$r \
               --gpu-repo b256:batch_size=256,$r --gpu-repo h08:hw_decoder_load=0.8,$r --gpu-repo t2:dali_threads=2,$r \
               --variant none='--engine triton @none' --variant b256='--engine triton @b256' \
               --variant h08='--engine triton @h08' --variant t2='--engine triton @t2' --variant default= ;;
    gpu)     timeout 330 python3 tests/benchmarks/bench_gpu.py --out "$OUT/f" --seconds 4 --sets imagenet,light \
               --parts dali,ceiling,engine,parity,oddities,triton --engine-variants dali_h1_d3 \
               --triton-nets resnet50 --servers ${GPU_SERVERS:-6:mps:bl4} --client 128x16 --client-procs 4 \
               --dali-depth 3 --hw-decoder-load 1.0 > "$OUT/f/gpu.log" 2>&1
             echo "bench_gpu rc=$?"; grep -E "^parity|^oddities|failures|^triton_" "$OUT/f/gpu.log" | cut -c1-330
             sed -n '/^network /,$p' "$OUT/f/gpu.log" | grep -v "None\|stage_ms\|^parity" ;;
    tests)   python3 -c "import pytest" 2>/dev/null || { echo "pytest is not installed here"; continue; }
             timeout 150 python3 -m pytest tests/gpu -m gpu -q -p no:cacheprovider -x > "$OUT/f/pytest.log" 2>&1
             echo "pytest rc=$?"; tail -5 "$OUT/f/pytest.log" ;;
    int8)    bash tests/benchmarks/device/int8_cpu.sh ;;
    *)       echo "unknown part $part (network start job ceiling gpu tests int8)" >&2; exit 2 ;;
  esac
done
