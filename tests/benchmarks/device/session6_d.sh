#!/usr/bin/env bash
# "Feed the GPU", session 6, call D (~5 min, right after C): every number of the issue in one call, with call C's best
# Triton shape. bench_gpu in one run: DALI alone (hw_decoder_load 0.65/0.9/1.0), the networks alone, the engine in
# process, parity, odd inputs, through the local Triton (ResNet-50 alone in the server, under MPS: 6 instances with a
# backlog of 4 batches, and 4 instances with 6); then the whole Ray job (gpu engine, 3 actors, 100,000 files from
# local disk to Parquet) with CPU by process.
set -u
source $HOME/env/activate.sh
mkdir -p $OUT/d $HOME/d
timeout 330 python3 tests/benchmarks/bench_gpu.py --out $HOME/d --seconds 4 --triton-images 16384 --sets imagenet,light \
  --decoder dali --parts dali,ceiling,engine,parity,oddities,triton --engine-variants dali_h1_d3 \
  --triton-nets resnet50 --servers 6:mps:bl4,4:mps:bl6 --client 128x16 --client-procs 4 --dali-depth 3 \
  --hw-decoder-load 1.0 > $OUT/d/bench.log 2>&1
echo "bench_gpu rc=$?"; cp $HOME/d/bench_gpu.json $OUT/d/
grep -E "^parity|^oddities|failures|^triton_resnet50" $OUT/d/bench.log | cut -c1-330
sed -n '/^network /,$p' $OUT/d/bench.log | grep -v "None\|stage_ms\|^parity"
timeout 170 python3 tests/benchmarks/cpu_by_process.py python3 tests/benchmarks/bench_scaleout.py --gpus 1 \
  --images 100000 --work $HOME/so100 --out $HOME/so100/outd --engine gpu --variants 3:3:own --decoder dali \
  --hw-decoder-load 1.0 --dali-depth 3 --batch-size 2048 > $OUT/d/scaleout.log 2>&1
echo "scaleout rc=$?"; cp $HOME/so100/outd/bench_scaleout.json $OUT/d/ 2>/dev/null
python3 -c "import json; d=json.load(open('$OUT/d/bench_scaleout.json'))[0]; print({k: d[k] for k in ('images', 'rows', 'unique_rows', 'every_row_once', 'steady_img_s', 'steady_window_s', 'startup_s')}, d['gpu'])"
head -12 $OUT/d/scaleout.log
