#!/usr/bin/env bash
# "Feed the GPU", session 5, call B (right after A; ~5 min): the whole Ray job, 100,000 files from local disk to
# Parquet: ResNet-50 is not the job's model, so the default model; Triton (3 actors sharing one server, 3 instances)
# and the gpu engine (3 actors per GPU, 3 calls each), each without and with MPS.
set -u
source $HOME/env/activate.sh
mkdir -p $OUT/b
COMMON="--gpus 1 --images 100000 --work $HOME/so --decoder dali --hw-decoder-load 1.0 --dali-depth 3 --batch-size 2048"
TRITON="--request-batch 128 --concurrency 8 --instances 3 --variants 3:2:shared"
timeout 60 python3 tests/benchmarks/bench_scaleout.py $COMMON --prepare-only --out $HOME/sob/prep > $HOME/sob-prep.log 2>&1
echo "prep rc=$?"
timeout 150 python3 tests/benchmarks/bench_scaleout.py $COMMON $TRITON --out $HOME/sob/triton > $OUT/b/triton.log 2>&1
echo "triton rc=$?"; sed -n '/^GPUs/,$p' $OUT/b/triton.log
timeout 120 python3 tests/benchmarks/bench_scaleout.py $COMMON --engine gpu --variants 3:3:own \
  --out $HOME/sob/gpu > $OUT/b/gpu.log 2>&1
echo "gpu engine rc=$?"; sed -n '/^GPUs/,$p' $OUT/b/gpu.log
if [ -e $HOME/mps_ok ]; then  # the MPS probe of call A passed
  timeout 150 python3 tests/benchmarks/bench_scaleout.py $COMMON $TRITON --mps --out $HOME/sob/triton_mps \
    > $OUT/b/triton_mps.log 2>&1
  echo "triton mps rc=$?"; sed -n '/^GPUs/,$p' $OUT/b/triton_mps.log
  timeout 120 python3 tests/benchmarks/bench_scaleout.py $COMMON --engine gpu --variants 3:3:own --mps \
    --out $HOME/sob/gpu_mps > $OUT/b/gpu_mps.log 2>&1
  echo "gpu engine mps rc=$?"; sed -n '/^GPUs/,$p' $OUT/b/gpu_mps.log
fi
for d in triton gpu triton_mps gpu_mps; do cp $HOME/sob/$d/bench_scaleout.json $OUT/b/$d.json 2>/dev/null; done
ls $OUT/b
