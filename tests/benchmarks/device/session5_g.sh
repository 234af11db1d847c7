#!/usr/bin/env bash
# "Feed the GPU", session 5, call G (~2 min, the last device minutes): the gpu profile's ensemble shape (3 preprocess
# instances + 1 network instance, GPU tensors between them) against the single shape (4 instances), both under MPS,
# ResNet-50 through the local Triton, 3 actor-shaped clients. Its first run on a GPU.
set -u
source $HOME/env/activate.sh
mkdir -p $OUT/g
timeout 150 python3 tests/benchmarks/bench_gpu.py --out $OUT/g --seconds 2 --sets imagenet --decoder dali \
  --parts triton --triton-nets resnet50 --servers 4:mps,3:mps:ens --network-instances 1 --client 128x16 \
  --client-procs 3 --dali-depth 3 --hw-decoder-load 1.0 > $OUT/g/bench.log 2>&1
echo "bench_gpu rc=$?"; grep -E "^triton_|failures|Error" $OUT/g/bench.log | cut -c1-400 | tail -8
