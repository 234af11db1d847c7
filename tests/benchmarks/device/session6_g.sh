#!/usr/bin/env bash
# "Feed the GPU", session 6, call G (~1.5 min): DALI alone at hw_decoder_load 0.65 / 0.9 / 1.0 (0.65 was left out of
# the dali part in sessions 3-5 and in call D), both sets, one run.
set -u
source $HOME/env/activate.sh
mkdir -p $OUT/g $HOME/g
timeout 200 python3 tests/benchmarks/bench_gpu.py --out $HOME/g --seconds 2 --sets imagenet,light --parts dali \
  > $OUT/g/bench.log 2>&1
echo "bench_gpu rc=$?"; cp $HOME/g/bench_gpu.json $OUT/g/; grep "dali_only" $OUT/g/bench.log
