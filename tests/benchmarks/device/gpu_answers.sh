#!/usr/bin/env bash
# A user's model on the GPU default gives that model's answers, and starts fast from the node's cache
# (docs/performance.md, "A user's model on the GPU"), after the kit's setup (README.md here):
#   KIT=DIR STEPS="import parity start steady set probe nets tests" [IMPORTS=... PARITY_MODELS=...] bash tests/benchmarks/device/gpu_answers.sh
# import: the folders `bulk-classify model import` writes here: timm tf_efficientnet_lite1 (its real weights,
#   KIT/lite1.pth), convnext_tiny and resnet50, torchvision resnet50 (random weights, seed 0); KIT/models holds the
#   Hugging Face ViT (imported where transformers is) and the real-weight Lite2 export (export_models.py lite2);
# parity: each folder through the default command and through --engine onnx on tests/data/parity/inputs, top-1
#   agreement with each disagreement's margin (compare_runs.py), and what the start did (the run's -v log);
# start: bench_job on 1,000 files: the built-in model, a user's ResNet-50 (export_models.py resnet50) with an empty
#   cache, the same again (cache warm), the built-in model again;
# steady: bench_job on 100,000 files: the built-in model, then the ResNet-50 (cache warm);
# FP32_MODELS: after parity, these folders again through --engine gpu in FP32 (half=false) against --engine onnx;
# set: bench_job on IMAGES files (100,000): the built-in model alone, then the built-in model and the timm ResNet-50
#   with its embedding (IMPORTS=r50emb: `model import ... --embedding`; SET_R50=r50demb: the same network with
#   decided answers, so the precision gate runs it in FP16 as a trained one) as a model set in one pass
#   (SET_PAIRS: the built-in model with each of these folders too; SET_ALONE: these folders alone; SET_EXTRA: the pair
#   once more with these arguments too, as variant pairx; SET_REPOS: NAME:KEY=VALUE,... gpu-profile repositories
#   bench_job builds, model=/more= naming the models, the pair served from each as variant pair-NAME), with the rows
#   counted, the embeddings' widths and norms read back with pyarrow, and the pair's top-1 against each model's own
#   run where there is one (with the score gaps of the rows where it differs);
# probe: after set (its files), the gpu engine in process on 8,192 of them (probe_set.py): the built-in model alone,
#   the pair, PROBE_VARIANTS: where the GPU's time goes without Ray or Triton;
# nets: the built-in network alone (bench_network.py, the served layout, cuDNN's autotuner off as in the served
#   instances; NET_LITE0=0 leaves it out) and a ResNet-50 folder alone (NET_R50, r50d: bench_user_networks.py,
#   compiled; NET_TUNINGS: its --tunings, NET_TIMEOUT_S: that run's limit, 240), the bound of the pair;
# tests: the GPU tier (pytest -m gpu tests/gpu).
# KIT holds whl/ (the onnx2torch and onnxslim wheels), lite1.pth and models/{hf-vit,lite2}. Results under $OUT.
set -u
source "$HOME/env/activate.sh"
kit=${KIT:?set KIT to the carried folder}
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/gasite "$kit"/whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/gasite:${PYTHONPATH:-}
models=$HOME/models48
work=$HOME/w48
mkdir -p "$models" "$work" "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, onnx2torch, onnxslim; from importlib.metadata import version as v
print('torch', torch.__version__, 'onnx2torch', v('onnx2torch'), 'onnxslim', v('onnxslim'), 'onnx', v('onnx'))"
start=$SECONDS
left() { echo $(( ${BUDGET_S:-580} - (SECONDS - start) )); }

import_models() {
  python3 - "$work" <<'EOF'
import sys, torch, timm, torchvision
work = sys.argv[1]
for name, make in {"convnext_tiny": lambda: timm.create_model("convnext_tiny"),
                   "resnet50": lambda: timm.create_model("resnet50"),
                   "tv-resnet50": lambda: torchvision.models.resnet50()}.items():
    torch.manual_seed(0)
    torch.save(make().state_dict(), f"{work}/{name}.pth")
# The timm ResNet-50 again with its classifier's weights x200: random weights decide none of the precision gate's
# sample (it keeps such a network in FP32, as it must); these decide 14 of 16, as a trained network does, so the gate
# measures FP16 against FP32 for it as for a user's trained ResNet-50, at the same cost per image.
torch.manual_seed(0)
net = timm.create_model("resnet50")
with torch.no_grad():
    net.fc.weight.mul_(200)
    net.fc.bias.zero_()
torch.save(net.state_dict(), f"{work}/resnet50-decided.pth")
EOF
  local t0
  for spec in "lite1 timm tf_efficientnet_lite1 $kit/lite1.pth" "convnext_tiny timm convnext_tiny $work/convnext_tiny.pth" \
              "resnet50 timm resnet50 $work/resnet50.pth" "tv-resnet50 torchvision resnet50 $work/tv-resnet50.pth" \
              "r50emb timm resnet50 $work/resnet50.pth --embedding" \
              "r50d timm resnet50 $work/resnet50-decided.pth" \
              "r50demb timm resnet50 $work/resnet50-decided.pth --embedding"; do
    set -- $spec
    [[ " ${IMPORTS:-lite1 convnext_tiny resnet50 tv-resnet50} " == *" $1 "* ]] || continue
    rm -rf "$models/$1"; t0=$SECONDS
    python3 -m pipeline.cli model import "$2" "$3" --checkpoint "$4" "${@:5}" --output "$models/$1" \
      > "$OUT/import-$1.log" 2>&1
    echo "import $1: rc=$? $(( SECONDS - t0 )) s; $(grep -E '^(parity|note: onnx)' "$OUT/import-$1.log" | tr '\n' ' ' | cut -c1-300)"
  done
  [[ -d $kit/models ]] && cp -r "$kit/models/hf-vit" "$kit/models/lite2" "$models/"
  if [[ " ${STEPS:-start} " == *" st"* && ! -f $models/r50user/model.onnx ]]; then  # a user's ResNet-50 (37 classes), for start/steady
    rm -rf "$work/exp"; python3 tests/benchmarks/device/export_models.py "$work/exp" resnet50 >/dev/null 2>&1
    mv "$work/exp/resnet50" "$models/r50user"
  fi
  ls "$models"
}

parity() {  # the default command against --engine onnx on the parity photos, one folder after another
  local inputs=tests/data/parity/inputs m t0 rc
  for m in ${PARITY_MODELS:-lite1 convnext_tiny resnet50 tv-resnet50 hf-vit lite2}; do
    (( $(left) > 60 )) || { echo "parity $m: skipped, $(left) s left"; continue; }
    rm -rf "$work/par-gpu-$m" "$work/par-cpu-$m"; t0=$SECONDS
    timeout 150 python3 -m pipeline.cli -v run $inputs --output "$work/par-gpu-$m" --model "$models/$m" \
      > "$OUT/par-gpu-$m.log" 2>&1; rc=$?
    echo "== $m: default command rc=$rc $(( SECONDS - t0 )) s"; t0=$SECONDS
    grep -E "its network for the GPU|start report|precision gate|ONNX Runtime:|runs uncompiled" "$OUT/par-gpu-$m.log" \
      | sed 's/^.*INFO //' | cut -c1-400 | sort -u | head -8
    timeout 120 python3 -m pipeline.cli run $inputs --output "$work/par-cpu-$m" --model "$models/$m" --engine onnx \
      --quiet > "$OUT/par-cpu-$m.log" 2>&1; echo "   onnx engine rc=$? $(( SECONDS - t0 )) s"
    python3 tests/benchmarks/device/compare_runs.py "$work/par-cpu-$m" "$work/par-gpu-$m" | tee "$OUT/parity-$m.txt"
  done
  for m in ${FP32_MODELS:-}; do  # the in-process gpu engine in FP32: what the precision gate's FP16 moved
    (( $(left) > 40 )) || { echo "fp32 $m: skipped, $(left) s left"; continue; }
    rm -rf "$work/par-fp32-$m"; t0=$SECONDS
    timeout 120 python3 -m pipeline.cli run $inputs --output "$work/par-fp32-$m" --model "$models/$m" --engine gpu \
      --engine-option half=false --quiet > "$OUT/par-fp32-$m.log" 2>&1
    echo "== $m: --engine gpu --engine-option half=false rc=$? $(( SECONDS - t0 )) s"
    python3 tests/benchmarks/device/compare_runs.py "$work/par-cpu-$m" "$work/par-fp32-$m" | tee "$OUT/parity-fp32-$m.txt"
  done
}

job() {  # bench_job: IMAGES files, the variants given
  local name=$1; shift
  mkdir -p "$OUT/$name"
  timeout "${JOB_S:-400}" python3 tests/benchmarks/bench_job.py --work "$HOME/job-$name" --out "$OUT/$name" "$@" \
    --timeout-s 200 > "$OUT/$name/bench.log" 2>&1
  echo "bench_job $name rc=$?"
  grep -v "^[0-9: ,-]*bench_job" "$OUT/$name/bench.log" | grep -v -i warn | tail -14
  for f in "$OUT/$name"/log-*.txt; do
    echo "-- $(basename "$f"):"; grep -E "its network for the GPU|tritonserver [0-9]+: |actor ready" "$f" \
      | sed 's/^.*INFO //' | cut -c1-420 | head -5
  done
}

for step in ${STEPS:-import parity start steady tests}; do
  echo "== $step ($(left) s left)"
  case $step in
    import) import_models ;;
    parity) parity ;;
    start) rm -rf "${BULK_CLASSIFY_CACHE_DIR:?}/gpu-networks"
           job start --images 1000 --variant builtin= --variant r50cold="--model $models/r50user" \
             --variant r50warm="--model $models/r50user" --variant builtin2= ;;
    steady) job steady --images "${IMAGES:-100000}" --variant builtin= --variant r50="--model $models/r50user" ;;
    set) variants=(--variant builtin= --variant pair="--model taxonomy=default --model r50=$models/${SET_R50:-r50emb}")
         for m in ${SET_PAIRS:-}; do variants+=(--variant "pair-$m=--model taxonomy=default --model r50=$models/$m"); done
         for m in ${SET_ALONE:-}; do variants+=(--variant "alone-$m=--model $models/$m"); done
         [[ -n ${SET_EXTRA:-} ]] && variants+=(--variant "pairx=--model taxonomy=default --model r50=$models/${SET_R50:-r50emb} $SET_EXTRA")
         for r in ${SET_REPOS:-}; do  # NAME:KEY=VALUE,... (bench_job --gpu-repo): the pair served from it, as pair-NAME
           variants+=(--gpu-repo "$r" --variant "pair-${r%%:*}=--model taxonomy=default --model r50=$models/${SET_R50:-r50emb} --engine triton @${r%%:*}")
         done
         job set --images "${IMAGES:-100000}" "${variants[@]}"
         python3 - "$HOME/job-set" "alone-${SET_R50:-r50emb}" <<'EOF2'
import sys, pathlib, numpy as np, pyarrow.dataset as ds, pyarrow.compute as pc
for out in sorted(pathlib.Path(sys.argv[1]).glob("out-*")):
    t = ds.dataset(str(out), format="parquet").to_table()
    line = f"{out.name}: rows {t.num_rows}, distinct uris {len(pc.unique(t['uri']))}, ok {pc.sum(pc.equal(t['status'], 'ok')).as_py()}"
    if "r50" in t.column_names and t.schema.field("r50").type.get_field_index("embedding") >= 0:
        ok = t.filter(pc.equal(t["status"], "ok"))
        e = np.stack(pc.struct_field(ok["r50"], "embedding").to_numpy(zero_copy_only=False))
        norms = np.linalg.norm(e, axis=1)
        line += f"; r50 embedding {e.shape[1]} wide, norms {norms.min():.5f}..{norms.max():.5f}"
        line += f", ok rows without taxonomy {pc.sum(pc.is_null(ok['taxonomy'])).as_py()}"
    print(line)
outs = {o.name: ds.dataset(str(o), format="parquet").to_table() for o in pathlib.Path(sys.argv[1]).glob("out-*")}
pairs = sorted(name for name in outs if name.startswith("out-pair"))
for alone, pair, column in [(a, p, c) for p in pairs for a, c in (("out-builtin", "taxonomy"), (f"out-{sys.argv[2]}", "r50"))]:
    if alone in outs and pair in outs:  # the pair's model answers as its own run does, row by row
        mine = dict(zip(outs[alone]["uri"].to_pylist(), zip(outs[alone]["labels"].to_pylist(),
                                                            outs[alone]["scores"].to_pylist())))
        theirs = zip(outs[pair]["uri"].to_pylist(), outs[pair][column].to_pylist())
        differ = [u for u, r in theirs if r is None or mine[u][0][0] != r["labels"][0]]
        line = f"{pair}.{column} top-1 = {alone}'s on {len(mine) - len(differ)} of {len(mine)} rows"
        if differ:  # near-ties rounded the other way, or wrong answers: the alone run's top-1 minus top-2 score
            gaps = {u: scores[0] - scores[1] for u, (_, scores) in mine.items()}
            line += (f"; score gap where they differ: max {max(gaps[u] for u in differ):.4f}, median "
                     f"{np.median([gaps[u] for u in differ]):.4f} (all rows' median {np.median(list(gaps.values())):.4f})")
        print(line)
EOF2
         ;;
    probe) timeout "${PROBE_S:-200}" python3 tests/benchmarks/device/probe_set.py "$HOME/job-set/images" --images 8192 \
             --seconds 12 --variant builtin= --variant pair="taxonomy=default,r50=$models/${SET_R50:-r50emb}" \
             ${PROBE_VARIANTS:-} 2>&1 | grep -v -i warn | tee "$OUT/probe_set.txt" | tail -12 ;;
    nets) mkdir -p "$OUT/nets"  # the pair's two networks alone, as the served path runs them: its bound
          [[ ${NET_LITE0:-1} == 1 ]] && timeout 150 python3 tests/benchmarks/bench_network.py --layouts mirror_gemm --no-timm --cudnn off \
            --seconds "${NET_S:-5}" --count 128 --cpu-check 4 --budget-s 100 --out "$OUT/nets" 2>&1 \
            | grep -v -i warn | tee "$OUT/nets/lite0.log" | tail -6
          timeout "${NET_TIMEOUT_S:-240}" python3 tests/benchmarks/device/bench_user_networks.py --compile "${NET_R50:-r50d}" \
            ${NET_TUNINGS:+--tunings "$NET_TUNINGS"} \
            --seconds "${NET_S:-5}" --out "$OUT/nets/r50.json" "$models/${NET_R50:-r50d}" 2>&1 \
            | grep -v -i warn | tee "$OUT/nets/r50.log" | tail -6 ;;
    tests) (( $(left) > 30 )) && timeout $(( $(left) - 5 )) python3 -m pytest -q -m gpu -p no:cacheprovider \
             ${TESTS:-tests/gpu} 2>&1 | tee "$OUT/tests.log" | tail -15 ;;
  esac
done
