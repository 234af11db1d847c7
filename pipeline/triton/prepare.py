"""`bulk-classify repo prepare`: put a production Triton repository for THIS node's GPU and TensorRT in place.

TensorRT plans load only on the GPU architecture (compute capability) and TensorRT version that built
them, so the image ships no plan. At start each GPU worker:

1. keeps the repository already at ``$BULK_CLASSIFY_REPOSITORY`` when its stamp names the same model,
   top-k, batch size and plan key and it serves this version's contract (a restart on a node with a persistent
   volume);
2. else fetches ``<plan cache>/<model>-<onnx sha>-k<top_k>-b<batch>/sm<cc>-trt<version>.tar.gz`` from
   ``$BULK_CLASSIFY_PLAN_CACHE`` (any fsspec URL, e.g. ``s3://bucket/trt-plans``) when it is there;
3. else builds the production profile with ``pipeline.triton.repository.build_repository`` (a few minutes on the
   GPU) and uploads it to the cache for the next node of the same kind.

The worker image's entrypoint runs it at start. Its options, their environment variables and defaults:
``bulk-classify repo prepare --help``. Exit status 0 when the repository is ready, 1 with the reason otherwise.
"""

from __future__ import annotations

import io
import json
import logging
import shutil
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from pipeline.errors import ModelError, TritonError
from pipeline.model.folder import load_model
from pipeline.schema import DEFAULT_TOP_K
from pipeline.triton import contract as tn
from pipeline.triton.checks import check_repository
from pipeline.triton.configs import DEFAULT_MAX_BATCH_SIZE
from pipeline.triton.profiles import PRODUCTION
from pipeline.triton.plans import find_plan, local_plan_key
from pipeline.triton.repository import build_repository

LOG = logging.getLogger(__name__)
STAMP = ".bulk-classify-repository.json"
DEFAULT_REPOSITORY = "/models/repository"


def cache_name(model_name: str, model_digest: str, key: Any, *, top_k: int, max_batch_size: int) -> str:
    """Cache object name of one built repository: model identity (its digest), output shape and plan key."""
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in model_name)
    sm = str(key.compute_capability).replace(".", "")
    return f"{safe}-{model_digest[:16]}-k{top_k}-b{max_batch_size}/sm{sm}-trt{key.tensorrt}.tar.gz"


def pack(folder: Path) -> bytes:
    """The repository folder as a gzipped tar (paths relative to it)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path in sorted(folder.rglob("*")):
            if path.name != STAMP:
                tar.add(path, arcname=str(path.relative_to(folder)), recursive=False)
    return buf.getvalue()


def unpack(data: bytes, folder: Path) -> None:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in tar.getmembers():  # a cache object is data, never trusted with paths outside the folder
            target = (folder / member.name).resolve()
            if not str(target).startswith(str(folder.resolve())) or member.issym() or member.islnk():
                raise ModelError(f"cache archive entry {member.name!r} escapes the repository; delete that object")
        tar.extractall(folder)


def _serves_the_contract(folder: Path) -> bool:
    """Does this repository serve the engine's contract (a kept or cached one may predate TAG/ECHO)?"""
    try:
        check_repository(folder)
    except ModelError as err:
        LOG.warning("repository %s does not serve this version's contract (%s); rebuilding it", folder, err)
        return False
    return True


def prepare(repository: str, model: str | None, *, plan_cache: str | None = None, top_k: int = DEFAULT_TOP_K,
            max_batch_size: int = DEFAULT_MAX_BATCH_SIZE, key: Any = None,
            build: Callable[..., Path] | None = None) -> dict[str, Any]:
    """Make ``repository`` a production repository whose plan matches this node; return what was done.

    ``key`` (a ``pipeline.triton.plans.PlanKey``) defaults to this node's; ``build`` to ``build_repository``.
    """
    key = key or local_plan_key()
    if key is None:
        raise TritonError("no GPU (nvidia-smi) or no TensorRT Python package here: a production repository "
                           "needs both; run this in the worker image on a GPU node")
    build = build or build_repository
    bundle = load_model(model)
    name = cache_name(bundle.name, bundle.digest, key, top_k=top_k, max_batch_size=max_batch_size)
    dest = Path(repository)
    stamp_path = dest / STAMP
    if stamp_path.is_file():
        stamp = json.loads(stamp_path.read_text())
        if stamp.get("cache_name") == name and _serves_the_contract(dest):
            find_plan(dest / tn.CLASSIFIER_TRT_MODEL, key)
            LOG.info("repository %s already holds %s", dest, name)
            return {**stamp, "action": "kept"}

    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".prepare-", dir=dest.parent))
    try:
        action = "built"
        fs = root = None
        if plan_cache:
            import fsspec  # noqa: PLC0415 - only with a cache

            fs, root = fsspec.core.url_to_fs(plan_cache)
            cached = f"{root.rstrip('/')}/{name}"
            try:
                data = fs.cat_file(cached)
            except FileNotFoundError:
                data = None
            if data is not None:
                unpack(data, work)
                action = "fetched"
                LOG.info("fetched %s from %s", name, plan_cache)
                if not _serves_the_contract(work):  # cached before the contract's last change: rebuilt, re-cached
                    shutil.rmtree(work)
                    work.mkdir()
                    action = "built"
        if action == "built":
            t0 = time.monotonic()
            LOG.info("building %s (TensorRT %s, sm%s); this takes minutes", name, key.tensorrt,
                     key.compute_capability)
            build(PRODUCTION, model, str(work), top_k=top_k, max_batch_size=max_batch_size)
            LOG.info("built in %.0f s", time.monotonic() - t0)
        find_plan(work / tn.CLASSIFIER_TRT_MODEL, key)  # a repository without this node's plan is no use
        check_repository(work)
        if action == "built" and fs is not None:
            target = f"{root.rstrip('/')}/{name}"
            fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)  # folders for local caches; no-op on S3
            fs.pipe_file(target, pack(work))  # one PUT: readers see all of it or none
            LOG.info("uploaded %s to %s", name, plan_cache)
        stamp = {"cache_name": name, "model": bundle.name, "model_digest": bundle.digest, "top_k": top_k,
                 "max_batch_size": max_batch_size, "compute_capability": key.compute_capability,
                 "tensorrt": key.tensorrt, "source": action, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        (work / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
        if dest.exists():
            shutil.rmtree(dest)
        work.rename(dest)
        return {**stamp, "action": action}
    finally:
        shutil.rmtree(work, ignore_errors=True)
