"""bulk-classify: offline bulk image classification from object storage to Parquet.

The Python API (docs/api.md): ``run`` a job from its ``RunConfig``, or drop ``Classifier`` into your own Ray Data
pipeline. They load on first use, so ``import pipeline`` stays cheap where only a submodule is wanted (the served
models import their modules inside tritonserver).
"""

__version__ = "0.1.0"
__all__ = ["Classifier", "RunConfig", "RunResult", "run"]
_API = {"Classifier": "pipeline.api", "RunResult": "pipeline.api", "run": "pipeline.api",
        "RunConfig": "pipeline.config"}


def __getattr__(name: str):
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
