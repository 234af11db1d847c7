#!/usr/bin/env bash
# "Feed the GPU", session 5, call C (~6 min): do the model's threads spin on their cores while they wait for the GPU?
# Same run: the engine in process with CUDA's default wait ("auto": spins) and with blocking waits; Triton with 4 and
# 5 instances under MPS, each way, and 4 without MPS; then py-spy (native frames) of the default model's 4 stubs,
# spinning and blocking.
set -u
source $HOME/env/activate.sh
mkdir -p $OUT/c $HOME/c $HOME/cs
timeout 400 python3 tests/benchmarks/bench_gpu.py --out $HOME/c --seconds 2 --sets imagenet --decoder dali \
  --parts ceiling,engine,triton --engine-variants dali_h1_d3,dali_h1_d3_block --triton-nets resnet50,default \
  --servers 4:mps,4:mps:block,5:mps:block,4:block --client 128x16 --client-procs 4 --dali-depth 3 \
  --hw-decoder-load 1.0 > $OUT/c/bench.log 2>&1
echo "bench_gpu rc=$?"; cp $HOME/c/bench_gpu.json $OUT/c/
sed -n '/^network /,$p' $OUT/c/bench.log | grep -v "naive\|None"
grep -E "failures" $OUT/c/bench.log | tail -3
timeout 150 python3 tests/benchmarks/bench_gpu.py --out $HOME/cs --seconds 3 --sets imagenet --decoder dali \
  --parts triton --triton-nets default --servers 4:mps,4:mps:block --client 128x16 --client-procs 4 \
  --dali-depth 3 --hw-decoder-load 1.0 --py-spy > $OUT/c/spy.log 2>&1
echo "spy rc=$?"; grep "^triton_default" $OUT/c/spy.log
for f in $HOME/cs/spy_*.txt; do cp $f $OUT/c/; done
ls -la $OUT/c
