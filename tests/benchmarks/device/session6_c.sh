#!/usr/bin/env bash
# "Feed the GPU", session 6, call C (~7 min, right after B): the whole job again with a longer steady window
# (100,000 files; call B's 36,000 gave a 2.9 s window), then through the local Triton, ResNet-50 alone, the knobs
# left: network batch 256 in the model (128 so far), 5 and 6 instances with a backlog, 8 DALI threads.
set -u
source $HOME/env/activate.sh
mkdir -p $OUT/c $HOME/c1 $HOME/c2 $HOME/c3
timeout 170 python3 tests/benchmarks/bench_scaleout.py --gpus 1 --images 100000 --work $HOME/so100 --out $HOME/so100/out \
  --engine gpu --variants 3:3:own --decoder dali --hw-decoder-load 1.0 --dali-depth 3 --batch-size 2048 \
  > $OUT/c/scaleout.log 2>&1
echo "scaleout rc=$?"; cp $HOME/so100/out/bench_scaleout.json $OUT/c/ 2>/dev/null
COMMON="--seconds 6 --triton-images 16384 --sets imagenet --decoder dali --parts triton --triton-nets resnet50
  --client 128x16 --client-procs 4 --dali-depth 3 --hw-decoder-load 1.0"
timeout 150 python3 tests/benchmarks/bench_gpu.py --out $HOME/c1 $COMMON --servers 4:mps:bl6 --triton-batch 256 \
  > $OUT/c/b256.log 2>&1; echo "b256 rc=$?"; cp $HOME/c1/bench_gpu.json $OUT/c/b256.json
timeout 200 python3 tests/benchmarks/bench_gpu.py --out $HOME/c2 $COMMON --servers 5:mps:bl6,6:mps:bl4 \
  > $OUT/c/inst.log 2>&1; echo "inst rc=$?"; cp $HOME/c2/bench_gpu.json $OUT/c/inst.json
timeout 100 python3 tests/benchmarks/bench_gpu.py --out $HOME/c3 $COMMON --servers 4:mps:bl6 --dali-threads 8 \
  > $OUT/c/t8.log 2>&1; echo "t8 rc=$?"; cp $HOME/c3/bench_gpu.json $OUT/c/t8.json
grep -h "^triton_resnet50" $OUT/c/*.log | cut -c1-330
