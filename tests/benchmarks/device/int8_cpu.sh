#!/usr/bin/env bash
# INT8 on the GPU machine's host CPU, pinned to 2 cores (taskset -c 0,1), after the kit's setup (README.md here):
#   bash tests/benchmarks/device/int8_cpu.sh [--images 1000] [--stamps DIR] [--job-images 2000] [--work DIR]
#       [--quantize-args '...'] [--skip-job] [--job-only MODEL_DIR] [--budget-s 530]
# 1. the CPU: lscpu's model name and whether avx512_vnni, avx_vnni and amx are there (ONNX Runtime picks its integer
#    kernels by them; docs/int8.md);
# 2. `python3 -m pipeline.cli model quantize` with the command's defaults (plus --quantize-args) on --images crops of
#    tests/data/photos (bench_vs_naive.make_images), and on the stamp composites of --stamps DIR when given
#    (tests/benchmarks/stamp_photos.py; they cannot be built here), each with --force so the benchmarks below have a
#    model, the gate's verdict printed; and the defaults on a smaller sample of the crops (300, 32 calibrate);
# 3. bench_int8.py: FP32 against both INT8 models through the onnx engine, side by side;
#    bench_cpu_engines.py: the onnx and openvino engines on FP32 and those models, shaped as the job's actor;
# 4. probe_ray_floor.py (Ray Data's own start), then bench_cpu_shape.py, the GPU hidden: the naive pipeline, our job
#    with FP32 and with the INT8 model (the first whose gate passed) on the onnx engine and on openvino, on
#    --job-images JPEGs.
# --job-only MODEL_DIR: step 4 alone, with that INT8 model folder (quantized elsewhere: calibration runs the FP32
# model, so the file does not depend on the CPU that made it).
# Everything runs under `taskset -c 0,1`; each step has its own timeout, cut so that the whole stays within
# --budget-s (default 530 s). Writes $OUT/i8/ (logs, the gate reports) when $OUT is set.
set -u
images=1000; job_images=2000; stamps=; quantize_args=; skip_job=; job_only=; budget_s=530
work=${TMPDIR:-/tmp}/int8-cpu
while (($#)); do
  case $1 in
    --images) images=$2; shift 2 ;;
    --job-images) job_images=$2; shift 2 ;;
    --stamps) stamps=$2; shift 2 ;;
    --quantize-args) quantize_args=$2; shift 2 ;;
    --work) work=$2; shift 2 ;;
    --skip-job) skip_job=1; shift ;;
    --job-only) job_only=$2; shift 2 ;;
    --budget-s) budget_s=$2; shift 2 ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "int8_cpu.sh: unknown argument $1 (--images N --job-images N --stamps DIR --quantize-args '...' --work DIR --skip-job --job-only DIR --budget-s S)" >&2; exit 2 ;;
  esac
done
[[ $images =~ ^[0-9]+$ && $job_images =~ ^[0-9]+$ && $budget_s =~ ^[0-9]+$ ]] || {
  echo "int8_cpu.sh: --images, --job-images and --budget-s take numbers" >&2; exit 2; }
[[ -z $job_only || -f $job_only/model.onnx ]] || { echo "int8_cpu.sh: --job-only $job_only has no model.onnx" >&2; exit 2; }
[[ -z $stamps || -d $stamps ]] || { echo "int8_cpu.sh: --stamps $stamps is not a folder" >&2; exit 2; }
[[ -f $HOME/env/activate.sh ]] && source "$HOME/env/activate.sh"
logs=${OUT:+$OUT/i8}; logs=${logs:-$work/logs}
mkdir -p "$work" "$logs"
pin="taskset -c 0,1"
start=$SECONDS
cap() { local left=$((budget_s - (SECONDS - start))); ((left < 5)) && left=5; echo $(($1 < left ? $1 : left)); }
# Ray sizes a local node by multiprocessing.cpu_count(), not by the affinity taskset sets, and the job's defaults
# (actors, decode threads) and bench_int8.py's "threads per core" follow os.cpu_count(): without this shim they would
# plan for every core of the host on 2.
shim=$work/cpu_shim; mkdir -p "$shim"
printf '%s\n' 'import os' '_CPUS = len(os.sched_getaffinity(0))' 'os.cpu_count = lambda: _CPUS' > "$shim/sitecustomize.py"
export PYTHONPATH=$shim${PYTHONPATH:+:$PYTHONPATH}

echo "== CPU"
lscpu | grep -m1 "Model name" | sed 's/  */ /g'
flags=$(grep -m1 '^flags' /proc/cpuinfo)
for f in avx2 avx512f avx512_vnni avx_vnni amx_tile amx_int8; do
  [[ " $flags " == *" $f "* ]] && echo "  $f: yes" || echo "  $f: no"
done
echo "  pinned: $($pin python3 -c 'import os; print(os.cpu_count())') CPUs seen by Python under taskset -c 0,1; load average $(cut -d' ' -f1-3 /proc/loadavg)"
python3 -c 'import onnx, onnxruntime; print("  onnxruntime", onnxruntime.__version__, "onnx", onnx.__version__)' || {
  echo "int8_cpu.sh: python3 needs onnxruntime and onnx (onnxruntime.quantization imports onnx)" >&2; exit 3; }

crops=$work/crops-$images
[[ -n $job_only ]] || python3 - "$crops" "$images" <<'EOF'
import sys
sys.path[:0] = ["tests/benchmarks", "tests"]
from pathlib import Path
from bench_vs_naive import make_images
make_images(Path(sys.argv[1]), int(sys.argv[2]))
EOF

quantize() {  # NAME SOURCE ARGS...: a --force'd model in $work/NAME, the gate's lines printed
  local name=$1 src=$2; shift 2
  rm -rf "$work/$name" "$work/$name.int8_gate.json"
  echo "== quantize $name: model quantize --calibration $src $*"
  local t0=$SECONDS
  # shellcheck disable=SC2086
  timeout "$(cap 120)" $pin python3 -m pipeline.cli model quantize --calibration "$src" --output "$work/$name" --force "$@" \
    > "$logs/quantize-$name.log" 2>&1
  echo "  rc=$? in $((SECONDS - t0)) s"
  grep -v "^WARNING" "$logs/quantize-$name.log" | tail -6
  [[ -f $work/$name/int8_gate.json ]] && cp "$work/$name/int8_gate.json" "$logs/$name.int8_gate.json"
  python3 - "$work/$name/int8_gate.json" <<'EOF'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except OSError:
    sys.exit(0)
f = r["figures"]
below = [c for c in f["classes"] if c["agreement"] < r["thresholds"]["min_class_agreement"]]
print(f"  gate {'PASSED' if r['passed'] else 'FAILED'}: top-1 {f['top1_agreement']:.2%}, decisive "
      f"{f['decisive_agreement']:.2%} of {f['decisive_images']}, top-5 {f['top5_overlap']:.2%}, classes below "
      f"{r['thresholds']['min_class_agreement']:.0%}: {len(below)} of {f['classes_gated']}; "
      + ("; ".join(r["failures"]) or "no failures"))
EOF
}

if [[ -z $job_only ]]; then
# shellcheck disable=SC2086
quantize int8-crops "$crops" $quantize_args
[[ -n $stamps ]] && quantize int8-stamps "$stamps" $quantize_args
# A smaller sample of the same crops (300 sampled, 32 calibrate): on the H200 host its gate passed (docs/int8.md).
quantize int8-small "$crops" --samples 300 --calibration-images 32

echo "== bench_int8.py (ms per image, medians of 3 interleaved rounds)"
models=(--int8 "$work/int8-crops"); [[ -d $work/int8-small ]] && models+=(--int8 "$work/int8-small")
timeout "$(cap 150)" $pin python3 tests/benchmarks/bench_int8.py "${models[@]}" --folder "$crops" --images 128 --rounds 3 \
  > "$logs/bench_int8.log" 2>&1
echo "  rc=$?"; grep -v "^WARNING\|^[0-9-]* [0-9:,]* " "$logs/bench_int8.log" | tail -14
echo "== bench_cpu_engines.py (the onnx and openvino engines as the job's actor, medians of 3 interleaved rounds)"
timeout "$(cap 120)" $pin python3 tests/benchmarks/bench_cpu_engines.py "${models[@]}" --folder "$crops" --images 256 \
  --rounds 3 > "$logs/bench_cpu_engines.log" 2>&1
echo "  rc=$?"; grep -v "^WARNING\|^[0-9-]* [0-9:,]* " "$logs/bench_cpu_engines.log" | tail -9
fi

if [[ -z $skip_job ]]; then
  # The job's INT8 model: --job-only's, else the first whose gate passed, else the full sample's.
  job_model=$work/int8-crops
  for m in int8-crops int8-small; do
    grep -q '"passed": true' "$work/$m/int8_gate.json" 2>/dev/null && { job_model=$work/$m; break; }
  done
  [[ -n $job_only ]] && job_model=$(cd "$job_only" && pwd)
  # bench_cpu_shape.py runs `bulk-classify`; the kit has the package on PYTHONPATH, not installed.
  command -v bulk-classify >/dev/null || {
    printf '#!/bin/sh\nexec python3 -m pipeline.cli "$@"\n' > "$shim/bulk-classify"; chmod +x "$shim/bulk-classify"
    export PATH=$shim:$PATH; }
  echo "== probe_ray_floor.py: Ray Data's own start on these 2 cores (one run of each pipeline; GPU hidden)"
  CUDA_VISIBLE_DEVICES= timeout "$(cap 90)" $pin python3 tests/benchmarks/probe_ray_floor.py --runs 1 \
    > "$logs/probe_ray_floor.log" 2>&1
  echo "  rc=$?"; tail -4 "$logs/probe_ray_floor.log"
  echo "== bench_cpu_shape.py: naive, our job FP32 and INT8 on onnx, INT8 on openvino ($job_model; $job_images JPEGs, 2 rounds; GPU hidden)"
  # The GPU hidden: on a GPU node auto picks the gpu profile, which has no INT8.
  CUDA_VISIBLE_DEVICES= timeout "$(cap 420)" $pin python3 tests/benchmarks/bench_cpu_shape.py --images "$job_images" \
    --rounds 2 --int8 "$job_model" --shape default= --shape "openvino INT8=--engine openvino --model $job_model" \
    --workdir "$work/shape" > "$logs/bench_cpu_shape.log" 2>&1
  echo "  rc=$?, load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
  grep -v "^WARNING\|^[0-9-]* [0-9:,]* \|^(.*pid=" "$logs/bench_cpu_shape.log" | tail -12
fi
echo "== int8_cpu.sh done in $((SECONDS - start)) s; logs in $logs"
