#!/usr/bin/env bash
# "Feed the GPU", session 6, call B (~8 min, right after call A): every number of the issue in one call, on this
# session's code. bench_gpu in one run: DALI alone (hw_decoder_load 0.65/0.9/1.0), the networks alone, the engine in
# process, parity, odd inputs, and through the local Triton (ResNet-50 and the default model in one server, 4
# instances under MPS, with call A's best backlog); then the whole Ray job (gpu engine, 3 actors, 36,000 files from
# local disk to Parquet) with CPU by process; then the GPU tests.
set -u
source $HOME/env/activate.sh
mkdir -p $OUT/b $HOME/b
best=$(python3 - <<'PY'
import json, os
d = json.load(open(os.path.expanduser("~/a/bench_gpu.json")))
key = "triton_resnet50_imagenet_r128_c16_p4_i4_mps_"
def score(b):
    runs = [d.get(key + b, {}).get("img_s"), d.get(key + b + "_afterbad", {}).get("img_s")]
    runs = [r for r in runs if r]
    return sum(runs) / len(runs) if runs else 0
print(max(("bl6", "bl12", "bl0"), key=score))
PY
)
echo "backlog from call A: ${best:=bl6}"
timeout 360 python3 tests/benchmarks/bench_gpu.py --out $HOME/b --seconds 4 --triton-images 16384 --sets imagenet,light \
  --decoder dali --parts dali,ceiling,engine,parity,oddities,triton --engine-variants dali_h1_d3 \
  --triton-nets resnet50,default --servers 4:mps:$best --client 128x16 --client-procs 4 --dali-depth 3 \
  --hw-decoder-load 1.0 > $OUT/b/bench.log 2>&1
echo "bench_gpu rc=$?"; cp $HOME/b/bench_gpu.json $OUT/b/
grep -E "^parity|^oddities|^streams|failures|dali_only" $OUT/b/bench.log | cut -c1-300
sed -n '/^network /,$p' $OUT/b/bench.log | grep -v "None\|stage_ms"
timeout 150 python3 tests/benchmarks/cpu_by_process.py python3 tests/benchmarks/bench_scaleout.py --gpus 1 \
  --images 36000 --work $HOME/so --out $HOME/so/out --engine gpu --variants 3:3:own --decoder dali \
  --hw-decoder-load 1.0 --dali-depth 3 --batch-size 2048 > $OUT/b/scaleout.log 2>&1
echo "scaleout rc=$?"; cp $HOME/so/out/bench_scaleout.json $OUT/b/ 2>/dev/null
sed -n "/^GPUs/,\$p" $OUT/b/scaleout.log | head -70
python3 -c "import pytest" 2>/dev/null && timeout 70 python3 -m pytest tests/test_engine_gpu.py tests/test_engine_dali.py \
  -m gpu -o addopts= -q -p no:cacheprovider -x > $OUT/b/pytest.log 2>&1; echo "pytest rc=$?"; tail -3 $OUT/b/pytest.log
