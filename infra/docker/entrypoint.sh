#!/usr/bin/env bash
# Worker container start: run the command given, else KubeRay's generated `ray start`
# ($KUBERAY_GEN_RAY_START_CMD, set when the RayJob has ray.io/overwrite-container-cmd).
#
# BULK_CLASSIFY_PREPARE=1 first puts the TensorRT production repository for this node's GPU at
# $BULK_CLASSIFY_REPOSITORY (`bulk-classify repo prepare`: keep, fetch or build its plan), for runs that pick it
# with --engine-option repository=...; unset or 0 skips it.
# Off by default: the default engine builds and caches its own gpu profile, and a plan build costs minutes per node.
set -euo pipefail

case "${BULK_CLASSIFY_PREPARE:-0}" in
    0) ;;
    1)
        if ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
            echo "entrypoint: BULK_CLASSIFY_PREPARE=1 but no GPU is visible (nvidia-smi -L failed);" \
                "set it on GPU nodes only" >&2
            exit 1
        fi
        bulk-classify repo prepare
        ;;
    *)
        echo "entrypoint: BULK_CLASSIFY_PREPARE must be 0 or 1, got '${BULK_CLASSIFY_PREPARE}'" >&2
        exit 2
        ;;
esac

if [ "$#" -gt 0 ]; then
    exec "$@"
elif [ -n "${KUBERAY_GEN_RAY_START_CMD:-}" ]; then
    exec bash -c "$KUBERAY_GEN_RAY_START_CMD"
else
    exec bash
fi
