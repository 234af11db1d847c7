#!/usr/bin/env bash
# "Feed the GPU", session 5, call D (~6 min): the whole Ray job, 100,000 files from local disk to Parquet, default
# model: the gpu engine (3 actors per GPU) waiting by spinning and by blocking; Triton (3 actors sharing one server)
# with 4 instances under MPS, spinning and blocking.
set -u
source $HOME/env/activate.sh
mkdir -p $OUT/d
COMMON="--gpus 1 --images 100000 --work $HOME/so --decoder dali --hw-decoder-load 1.0 --dali-depth 3 --batch-size 2048"
TRITON="--request-batch 128 --concurrency 8 --instances 4 --variants 3:2:shared --mps"
timeout 60 python3 tests/benchmarks/bench_scaleout.py $COMMON --prepare-only --out $HOME/sod/prep > $HOME/sod-prep.log 2>&1
echo "prep rc=$?"
run() {  # name, timeout, options...
  local name=$1 limit=$2; shift 2
  timeout $limit python3 tests/benchmarks/bench_scaleout.py $COMMON "$@" --out $HOME/sod/$name > $OUT/d/$name.log 2>&1
  echo "$name rc=$?"; sed -n '/^GPUs/,$p' $OUT/d/$name.log
  cp $HOME/sod/$name/bench_scaleout.json $OUT/d/$name.json 2>/dev/null
}
run gpu_block 100 --engine gpu --variants 3:3:own --cuda-sync block
run gpu_auto 100 --engine gpu --variants 3:3:own --cuda-sync auto


ls $OUT/d
