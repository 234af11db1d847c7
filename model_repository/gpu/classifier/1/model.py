"""Triton python-backend entry of the gpu profile; the model is pipeline.triton.serve.gpu_model.TritonPythonModel
(written by `bulk-classify repo build --profile gpu`, do not edit)."""

import os
import sys

sys.path[:0] = [p for p in os.environ.get("BULK_CLASSIFY_PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]

from pipeline.triton.serve.gpu_model import TritonPythonModel  # noqa: E402,F401
