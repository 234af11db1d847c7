#!/usr/bin/env bash
# "Feed the GPU", session 5, call A (after the carry; ~8 min): can several Triton model instances per GPU, each its
# own stub process and CUDA context, with or without CUDA MPS, take ResNet-50 through the local Triton past 12k img/s?
# Same run: the network alone, the engine in process, and Triton with 3 instances (time-sliced), 3 and 4 under MPS,
# from 3 and 4 actor-shaped client processes; then the hop alone (no network) with 1 and 3 instances.
set -u
source $HOME/env/activate.sh
mkdir -p $OUT/a
nvidia-smi --query-gpu=name,compute_mode,driver_version --format=csv,noheader
SERVERS=3
if command -v nvidia-cuda-mps-control >/dev/null; then
  # MPS probe: a private daemon, one CUDA client beside a live non-MPS context; 40 s at most.
  timeout 40 python3 - <<'PY' && SERVERS=3,3:mps,4:mps && touch $HOME/mps_ok
import subprocess, sys, tempfile
from pathlib import Path
import torch
here = torch.ones(1, device="cuda")  # a non-MPS context alive beside the MPS clients, as in bench_gpu.py
sys.path.insert(0, "tests/benchmarks")
from gpu_mps import log_tail, mps
with mps(Path(tempfile.mkdtemp(prefix="mps-probe-"))) as logs:
    r = subprocess.run([sys.executable, "-c", "import torch; x = torch.ones(1 << 20, device='cuda'); "
                        "print('mps client ok', float(x.sum()))"], timeout=30)
    print(log_tail(logs, 5))
sys.exit(r.returncode)
PY
fi
echo "servers: $SERVERS"
timeout 470 python3 tests/benchmarks/bench_gpu.py --out $OUT/a --seconds 2 --sets imagenet --decoder dali \
  --parts ceiling,engine,triton --engine-variants dali_h1_d3 --triton-nets resnet50,default --servers $SERVERS \
  --client 128x16 --client-procs 3,4 --dali-depth 3 --hw-decoder-load 1.0 > $OUT/a/bench.log 2>&1
echo "bench_gpu rc=$?"
sed -n '/^network /,$p' $OUT/a/bench.log | grep -v "naive\|None"
grep -E "failures|Error|error" $OUT/a/bench.log | tail -5
timeout 100 python3 tests/benchmarks/bench_hop.py --kind gpu --instances 1,3 --client-procs 1,3 --images 2048 --wires encoded \
  --rounds 1 --settle-s 3 > $OUT/a/hop.log 2>&1
echo "bench_hop rc=$?"; tail -12 $OUT/a/hop.log
