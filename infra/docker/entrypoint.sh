#!/usr/bin/env bash
# Worker container start: prepare the Triton repository for this node's GPU (fetch or build its TensorRT
# plan: `bulk-classify repo prepare`), then run the command: the arguments given, else KubeRay's generated
# `ray start` ($KUBERAY_GEN_RAY_START_CMD, set when the RayJob has ray.io/overwrite-container-cmd).
#
# Set BULK_CLASSIFY_PREPARE=0 to skip preparation (the CPU head does: it runs only the driver).
set -euo pipefail

if [ "${BULK_CLASSIFY_PREPARE:-auto}" != "0" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        bulk-classify repo prepare
    elif [ "${BULK_CLASSIFY_PREPARE:-auto}" = "1" ]; then
        echo "entrypoint: BULK_CLASSIFY_PREPARE=1 but no GPU is visible (nvidia-smi -L failed)" >&2
        exit 1
    else
        echo "entrypoint: no GPU visible; skipping the TensorRT repository (CPU node)" >&2
    fi
fi

if [ "$#" -gt 0 ]; then
    exec "$@"
elif [ -n "${KUBERAY_GEN_RAY_START_CMD:-}" ]; then
    exec bash -c "$KUBERAY_GEN_RAY_START_CMD"
else
    exec bash
fi
