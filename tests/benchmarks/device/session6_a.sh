#!/usr/bin/env bash
# "Feed the GPU", session 6, call A (~8 min): through the local Triton, ResNet-50 FP16 alone in the server, 4 model
# instances under CUDA MPS, clients shaped like 4 actors (128 x 16 in flight each), longer timed windows (6 s, 16,384
# images per client call). Servers, one after another: session 5's shape (no backlog, BatchNorms unfolded), then the
# network with its BatchNorms folded without and with a backlog per instance (6 and 12 network batches of 128). In each server the
# first timed run is repeated after the bad-inputs request (session 5's lead). Then the network alone under
# torch.compile (its own process: compiling may be slow).
set -u
source $HOME/env/activate.sh
mkdir -p $OUT/a $HOME/a $HOME/ac
timeout 420 python3 tests/benchmarks/bench_gpu.py --out $HOME/a --seconds 6 --triton-images 16384 --sets imagenet \
  --decoder dali --parts ceiling,triton --ceiling-variants folded,plain --triton-nets resnet50 \
  --servers 4:mps:bl0:nofold,4:mps:bl0,4:mps:bl6,4:mps:bl12 --client 128x16 --client-procs 4 --dali-depth 3 \
  --hw-decoder-load 1.0 --bad-inputs between > $OUT/a/bench.log 2>&1
echo "bench_gpu rc=$?"; cp $HOME/a/bench_gpu.json $OUT/a/
grep -E "model only|^triton_resnet50|^streams|failures" $OUT/a/bench.log | cut -c1-400
timeout 110 python3 tests/benchmarks/bench_gpu.py --out $HOME/ac --seconds 4 --sets imagenet --parts ceiling \
  --ceiling-variants compile > $OUT/a/compile.log 2>&1
echo "compile rc=$?"; grep -E "model only|failures" $OUT/a/compile.log | cut -c1-300
