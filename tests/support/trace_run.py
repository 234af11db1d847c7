"""Follow one small local run in the driver and count what it decides: engine spec lookups, preflights, config
resolutions, GPU counts, storage opens per URL, the job's ``ray.cluster_resources()`` calls and reads of RAY_ADDRESS.

    python tests/support/trace_run.py [auto|onnx|triton|cli] [previous]

``cli`` runs ``bulk-classify run SRC -o OUT -q`` in process; ``triton`` runs the triton engine's portable profile
(the GPU engines' path: batch size and model check by the GPU count); ``previous`` measures a run that carries over
from an earlier one. ``tests/integration/test_job.py::test_a_run_is_decided_once`` asserts the same counts.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def sample_folder(prefix: str) -> tuple[Path, Path, Path]:
    """A temp folder (``prefix``) with two sample photos in ``src/`` and room for ``out/``: (tmp, src, out)."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    src, out = tmp / "src", tmp / "out"
    src.mkdir()
    for name in ("coffee.jpg", "chelsea.jpg"):
        shutil.copy(REPO / "tests" / "data" / "photos" / name, src / name)
    return tmp, src, out


def main(engine: str = "auto", previous: bool = False) -> Counter:
    from pipeline.job import run_job
    from pipeline.node import local_ray_env

    local_ray_env()
    import ray

    import pipeline.engines.auto as auto
    import pipeline.node as node
    from pipeline.config import RunConfig
    from pipeline.engines import registry
    from pipeline.storage import open_fs

    tmp, src, out = sample_folder("trace-run-")
    options = {} if engine in ("auto", "cli") else {"engine": engine}
    if engine == "triton":
        options["engine_options"] = {"profile": "portable"}
    prev = None
    if previous:
        prev = str(tmp / "prev")
        run_job(RunConfig(source=str(src), output=prev, **options))
    watched = {registry.engine_spec.__code__: "engine_spec", open_fs.__code__: "open_fs",
               auto.cluster_gpus.__code__: "cluster_gpus", node.node_gpus.__code__: "node_gpus",
               node.ray_address.__code__: "ray_address", os._Environ.__getitem__.__code__: "environ"}
    for name in ("resolve", "resolved"):
        if hasattr(RunConfig, name):
            watched[getattr(RunConfig, name).__code__] = "RunConfig." + name
    for spec in registry.REGISTRY.values():
        watched[type(spec).check.__code__] = "preflight"
    calls: Counter = Counter()

    def profile(frame, event, _arg):
        name = watched.get(frame.f_code) if event == "call" else None
        if name is None:
            return
        caller = frame.f_back
        if name == "environ":
            if frame.f_locals.get("key") != "RAY_ADDRESS":
                return
            while caller.f_code.co_name in ("get", "__getitem__", "getenv"):  # Mapping.get, os.getenv
                caller = caller.f_back
            if "pipeline" not in Path(caller.f_code.co_filename).parts:
                return  # Ray's own
            name = "RAY_ADDRESS read"
        elif name == "open_fs":
            name = "open_fs " + frame.f_locals["url"].replace(str(tmp), "TMP")
        calls[f"{name} <- {Path(caller.f_code.co_filename).name}:{caller.f_code.co_name}"] += 1

    cluster_resources = ray.cluster_resources

    def counted(*args, **kwargs):  # Ray Data's executor asks too, through Ray's own modules: the job's calls only
        caller = sys._getframe(1).f_code
        calls[f"ray.cluster_resources <- {Path(caller.co_filename).name}:{caller.co_name}"] += 1
        return cluster_resources(*args, **kwargs)

    ray.cluster_resources = counted
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        if engine == "cli":
            from pipeline.cli import main as cli

            cli(["run", str(src), "-o", str(out), "-q"], standalone_mode=False)
        else:
            run_job(RunConfig(source=str(src), output=str(out), previous=prev, **options))
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        ray.cluster_resources = cluster_resources
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    return calls


if __name__ == "__main__":
    counted_calls = main(sys.argv[1] if len(sys.argv) > 1 else "auto", "previous" in sys.argv[2:])
    for key, count in sorted(counted_calls.items()):
        print(f"{count:3d}  {key}")
