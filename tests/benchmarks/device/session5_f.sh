#!/usr/bin/env bash
# "Feed the GPU", session 5, call F (~4 min): the DALI-only gpu classifier (hand-written decoders removed) on the
# H200: the GPU tests, then parity, odd inputs, the engine in process and Triton (3 instances) in one bench_gpu run.
set -u
source $HOME/env/activate.sh
mkdir -p $OUT/f
python3 -c "import pytest" 2>/dev/null && timeout 150 python3 -m pytest tests/test_engine_gpu.py tests/test_engine_dali.py \
  -m gpu -o addopts= -q -p no:cacheprovider -x > $OUT/f/pytest.log 2>&1; echo "pytest rc=$?"; tail -5 $OUT/f/pytest.log
timeout 260 python3 tests/benchmarks/bench_gpu.py --out $HOME/f --seconds 2 --sets imagenet --decoder dali \
  --parts ceiling,engine,parity,oddities,triton --engine-variants dali_h1_d3 --triton-nets resnet50 --servers 3 \
  --client 128x16 --client-procs 3 --dali-depth 3 > $OUT/f/bench.log 2>&1
echo "bench_gpu rc=$?"; cp $HOME/f/bench_gpu.json $OUT/f/
grep -E "^parity|^oddities|failures" $OUT/f/bench.log; sed -n '/^network /,$p' $OUT/f/bench.log | grep -v "None"
