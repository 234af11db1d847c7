"""The triton engine's repositories, built once into the model cache: one folder per profile, model, top-k and shape,
reused by every actor and run that asks for the same one."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Sequence

from pipeline.model.folder import BUILD_LOCK_TIMEOUT_S, default_cache_dir, is_builtin, load_model
from pipeline.triton.repository import build_repository

LOG = logging.getLogger(__name__)


REPOSITORY_CACHE = "repositories"


def cached_repository(profile, bundle, *, top_k: int, instances: int | None = None,
                      cache_dir: Path | None = None, more: Sequence = (), half: bool | None = None) -> Path:
    """The repository of ``profile`` (a ``pipeline.triton.profiles.ServingProfile``) for ``bundle``, built once
    into the model cache and reused by every engine and run that asks for the same one.

    The key covers the profile, the model's digest (its files, labels and spec: ``ModelBundle.digest``), a model
    set's other models (``more``: their names and digests, in order), top-k, the instance count, a forced precision
    (``half``, gpu profile) and this package's generating code, so a changed model, spec or release builds afresh.
    Concurrent builders wait on a file lock; the folder appears by an atomic rename, so a server never sees half a
    repository.
    """
    from filelock import FileLock  # noqa: PLC0415


    bundle = bundle if bundle is not None else load_model(None)
    instances = instances or profile.instances_for(1 + len(more))
    code = b"".join(Path(__file__).with_name(m).read_bytes()
                    for m in ("repository.py", "configs.py", "plans.py", "repository_cache.py"))
    key = [profile.name, bundle.digest, top_k, instances, profile.max_backlog, hashlib.sha256(code).hexdigest()]
    if more:  # a single model's key has no set part
        key.append([[b.name, b.digest] for b in more])
    if half is not None:  # the gate's verdict (None) keeps the key it always had
        key.append({"half": half})
    key = json.dumps(key)
    root = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / REPOSITORY_CACHE
    folder = root / f"{profile.name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if folder.is_dir():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock", timeout=BUILD_LOCK_TIMEOUT_S):
        if folder.is_dir():
            return folder
        tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
        try:
            build_repository(profile.name, _folder(bundle), str(tmp), top_k=top_k, instances=instances,
                             max_backlog=profile.max_backlog, more=[_folder(b) for b in more], half=half)
            os.replace(tmp, folder)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    LOG.info("built the %s repository into %s", profile.name, folder)
    return folder


def _folder(bundle) -> str | None:
    """What ``build_repository`` is given for ``bundle``: None for the built-in model, else its folder."""
    return None if is_builtin(bundle) else str(Path(bundle.onnx_path).parent.resolve())
