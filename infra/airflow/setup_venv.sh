#!/usr/bin/env bash
# Create the SEPARATE Airflow virtualenv at <repo>/.venv-airflow (Airflow's pins clash with the pipeline's).
#
# Airflow's own constraints files live outside PyPI, so the few packages that matter are pinned here
# instead: Airflow itself, its standard provider, and the Ray client the DAG submits with (same minor
# as the cluster's Ray, since the job submission REST API is versioned with Ray).
#
# Usage: bash infra/airflow/setup_venv.sh            (PYTHON=python3.11 to pick the interpreter)
# Idempotent: an existing venv with the pinned Airflow is left as it is.
set -euo pipefail

AIRFLOW_VERSION="3.3.2"
STANDARD_PROVIDER_VERSION="1.21.0"
RAY_VERSION="2.60.0"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${AIRFLOW_VENV:-$ROOT/.venv-airflow}"
PYTHON="${PYTHON:-python3}"

if [ -x "$VENV/bin/airflow" ] && "$VENV/bin/python" -c "
import importlib.metadata as m, sys
import aiohttp, requests
sys.exit(m.version('apache-airflow') != '$AIRFLOW_VERSION' or m.version('ray') != '$RAY_VERSION')" 2>/dev/null; then
    echo "airflow venv ready: $VENV (apache-airflow $AIRFLOW_VERSION, ray $RAY_VERSION)"
    exit 0
fi

"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# ray without extras: JobSubmissionClient needs only its HTTP client side (requests + aiohttp), not the
# dashboard and metrics stack of ray[default], whose OpenTelemetry pins would fight Airflow's.
"$VENV/bin/python" -m pip install --quiet \
    "apache-airflow==$AIRFLOW_VERSION" \
    "apache-airflow-providers-standard==$STANDARD_PROVIDER_VERSION" \
    "ray==$RAY_VERSION" \
    "aiohttp>=3.9,<4" \
    "requests>=2.31,<3" \
    "pyyaml>=6"
"$VENV/bin/python" -c "
import airflow, ray
from ray.job_submission import JobSubmissionClient
print('airflow', airflow.__version__, 'ray', ray.__version__)"
echo "airflow venv ready: $VENV"
